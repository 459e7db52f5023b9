"""A fake OpenAI Chat Completions server on loopback, scripted per test.

It is a plain ASGI app under uvicorn in a thread of its own, so the adapter meets real HTTP:
chunked SSE bodies, keep-alive, status answers with headers, and connections that break. Each
request takes the next behaviour from a queue (``respond_text``, ``fail_status``,
``truncate_after``...); the server records every request (path, headers, JSON body) and every
client that went away mid-stream, so a test can assert that an abort reached the upstream.

The stream is the Chat Completions format: ``data: {chunk}\\n\\n`` lines whose chunks carry
``id``, ``object: "chat.completion.chunk"``, ``choices[0].delta`` and ``finish_reason``, a final
chunk with empty ``choices`` and the ``usage`` when ``stream_options.include_usage`` is set, then
``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Literal

import uvicorn

from tests.helpers import read_request

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Fault = Literal["none", "error_event", "truncate", "abrupt", "stall"]

COMPLETIONS_PATH = "/v1/chat/completions"


class _Abort(Exception):
    """Raised inside a response to make uvicorn drop the connection mid-body."""


class _QuietAbort(logging.Filter):
    """Keeps uvicorn from logging the traceback of a scripted abort."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _Abort))


logging.getLogger("uvicorn.error").addFilter(_QuietAbort())


@dataclasses.dataclass(frozen=True)
class Behaviour:
    """What the server does with one request."""

    deltas: tuple[str, ...] = ()
    tool_call: tuple[str, str, tuple[str, ...]] | None = None  # (call id, name, argument parts)
    usage: tuple[int, int] = (11, 0)  # prompt tokens, completion tokens (0: one per part)
    status: int | None = None  # answer this status instead of a stream
    retry_after: str | None = None
    retry_after_ms: str | None = None
    message: str | None = None
    fault: Fault = "none"
    fault_after: int = 0  # deltas sent before the fault
    error_status: int | None = None  # the ``code`` of an in-stream error object
    interval_s: float = 0.0  # pause before each delta


@dataclasses.dataclass
class Recorded:
    """One request as the server received it, and how far its answer got."""

    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    client_port: int  # the same port twice: the client reused its connection
    deltas_sent: int = 0
    disconnected_at: float | None = None  # monotonic time the client was seen gone mid-stream


class FakeOpenAI:
    """A scripted Chat Completions server; ``url`` is its origin (the API is under ``/v1``)."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.disconnected = threading.Event()  # set when a client leaves before the end
        self._script: collections.deque[Behaviour] = collections.deque()
        self._ids = itertools.count(1)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # --- scripting -----------------------------------------------------------------------

    def respond_text(
        self,
        deltas: Sequence[str],
        *,
        usage: tuple[int, int] = (11, 0),
        interval_s: float = 0.0,
    ) -> None:
        """Stream ``deltas`` and finish with ``stop`` (``interval_s`` paces a slow stream)."""
        self._script.append(Behaviour(tuple(deltas), usage=usage, interval_s=interval_s))

    def respond_tool_call(
        self,
        name: str,
        arguments_parts: Sequence[str],
        *,
        call_id: str = "call_1",
        text: Sequence[str] = (),
    ) -> None:
        """Stream ``text``, then one function call in parts, and finish with ``tool_calls``."""
        call = (call_id, name, tuple(arguments_parts))
        self._script.append(Behaviour(tuple(text), tool_call=call))

    def fail_status(
        self,
        status: int,
        *,
        retry_after: str | None = None,
        retry_after_ms: str | None = None,
        message: str | None = None,
    ) -> None:
        """Answer an HTTP error. A 401 without ``message`` names the key it got, in full, as a
        careless server might: the adapter must not pass it on."""
        self._script.append(
            Behaviour(
                status=status,
                retry_after=retry_after,
                retry_after_ms=retry_after_ms,
                message=message,
            )
        )

    def error_event_after(
        self, n_deltas: int, *, status: int | None = None, message: str = "the model crashed"
    ) -> None:
        """Stream ``n_deltas`` deltas, then a ``data: {"error": ...}`` event (and ``[DONE]``)."""
        self._script.append(
            Behaviour(
                _words(n_deltas),
                fault="error_event",
                fault_after=n_deltas,
                error_status=status,
                message=message,
            )
        )

    def truncate_after(self, n_deltas: int, *, abrupt: bool = False) -> None:
        """Stream ``n_deltas`` deltas and end without ``finish_reason`` or ``[DONE]``: a clean
        end of the HTTP body, or (``abrupt``) a connection closed in the middle of it."""
        fault: Fault = "abrupt" if abrupt else "truncate"
        self._script.append(Behaviour(_words(n_deltas), fault=fault, fault_after=n_deltas))

    def stall_after(self, n_deltas: int) -> None:
        """Stream ``n_deltas`` deltas, then say nothing until the client goes away."""
        self._script.append(Behaviour(_words(n_deltas), fault="stall", fault_after=n_deltas))

    # --- what happened -------------------------------------------------------------------

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests]

    def wait_disconnect(self, timeout: float) -> Recorded:
        """The request whose client went away mid-stream; fails after ``timeout`` seconds."""
        if not self.disconnected.wait(timeout):
            raise AssertionError(f"no client disconnected within {timeout} s")
        return next(r for r in self.requests if r.disconnected_at is not None)

    # --- serving -------------------------------------------------------------------------

    def start(self) -> FakeOpenAI:
        config = uvicorn.Config(
            self,
            host="127.0.0.1",
            port=0,
            lifespan="off",
            log_config=None,
            log_level=None,
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(
            target=lambda: asyncio.run(server.serve()), name="fake-openai", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake OpenAI server did not start")
            time.sleep(0.005)
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)

    # --- the ASGI app --------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = await read_request(scope, receive)
        if request is None:
            return
        raw, headers = request
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {"_unparsed": raw.decode("utf-8", "replace")}
        client = scope.get("client") or ("", 0)
        record = Recorded(scope["method"], scope["path"], headers, body, int(client[1]))
        self.requests.append(record)
        if scope["path"] != COMPLETIONS_PATH or scope["method"] != "POST":
            await _json(send, 404, _error(f"no route {scope['method']} {scope['path']}", 404))
            return
        if not body.get("stream"):
            await _json(send, 400, _error("this fake only streams", 400))
            return
        behaviour = self._script.popleft() if self._script else None
        if behaviour is None:
            await _json(send, 500, _error("fake OpenAI: nothing scripted for this request", 500))
            return
        if behaviour.status is not None:
            await self._fail(send, behaviour, headers)
            return
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await self._stream(send, behaviour, body, record, gone)
        finally:
            gone.cancel()

    async def _fail(self, send: Send, behaviour: Behaviour, headers: dict[str, str]) -> None:
        status = behaviour.status or 500
        message = behaviour.message
        if message is None:
            key = headers.get("authorization", "").removeprefix("Bearer ")
            known = {401: f"Incorrect API key provided: {key}", 429: "Rate limit reached"}
            message = known.get(status, f"HTTP {status}")
        extra = [
            (name, value.encode())
            for name, value in (
                (b"retry-after", behaviour.retry_after),
                (b"retry-after-ms", behaviour.retry_after_ms),
            )
            if value is not None
        ]
        await _json(send, status, _error(message, status), extra)

    async def _stream(
        self,
        send: Send,
        behaviour: Behaviour,
        body: dict[str, Any],
        record: Recorded,
        gone: asyncio.Future[None],
    ) -> None:
        chunk_id = f"chatcmpl-fake{next(self._ids)}"
        model = str(body.get("model", ""))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            data: dict[str, Any] = {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "system_fingerprint": "fp_fake",
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                ],
            }
            if include_usage:
                data["usage"] = None
            return data

        async def emit(data: dict[str, Any] | str) -> bool:
            """Send one SSE event; False when the client is gone (recorded)."""
            if gone.done():
                return self._gone(record)
            line = data if isinstance(data, str) else json.dumps(data)
            try:
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": f"data: {line}\n\n".encode(),
                    }
                )
            except OSError:
                return self._gone(record)
            return True

        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-request-id", chunk_id.encode()),
                ],
            }
        )
        if not await emit(chunk({"role": "assistant", "content": ""})):
            return
        for text in behaviour.deltas:
            if behaviour.fault != "none" and record.deltas_sent >= behaviour.fault_after:
                break
            if behaviour.interval_s > 0:
                await asyncio.wait([gone], timeout=behaviour.interval_s)
            if not await emit(chunk({"content": text})):
                return
            record.deltas_sent += 1
        if behaviour.fault == "stall":
            await gone
            self._gone(record)
            return
        if behaviour.fault == "abrupt":
            raise _Abort("the connection breaks mid-body")  # uvicorn drops the connection
        if behaviour.fault == "truncate":
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if behaviour.fault == "error_event":
            error = {
                "message": behaviour.message,
                "type": "server_error",
                "param": None,
                "code": behaviour.error_status,
            }
            if await emit({"error": error}) and await emit("[DONE]"):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        finish = "stop"
        parts = len(behaviour.deltas)
        if behaviour.tool_call is not None:
            call_id, name, arguments = behaviour.tool_call
            first = {
                "index": 0,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            if not await emit(chunk({"tool_calls": [first]})):
                return
            for part in arguments:
                tool_delta = {"tool_calls": [{"index": 0, "function": {"arguments": part}}]}
                if not await emit(chunk(tool_delta)):
                    return
            finish, parts = "tool_calls", parts + len(arguments)
        if not await emit(chunk({}, finish)):
            return
        if include_usage:
            prompt, completion = behaviour.usage
            completion = completion or parts
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            final = {**chunk({}), "choices": [], "usage": usage}
            if not await emit(final):
                return
        if await emit("[DONE]"):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _gone(self, record: Recorded) -> bool:
        if record.disconnected_at is None:
            record.disconnected_at = time.monotonic()
        self.disconnected.set()
        return False


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _json(
    send: Send, status: int, payload: dict[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    data = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _error(message: str, status: int) -> dict[str, Any]:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


WORDS = ("Once", " upon", " a", " time", " a", " café", " in", " 日本", " served", " 🚀")


def _words(n: int) -> tuple[str, ...]:
    """``n`` deltas of a deterministic text, a few with multi-byte characters."""
    return tuple(WORDS[i % len(WORDS)] for i in range(n))


def scripted_text(n: int) -> str:
    """The text of the ``n`` deltas a scripted fault sends before it strikes."""
    return "".join(_words(n))
