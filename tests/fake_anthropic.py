"""A fake Anthropic Messages API on loopback that speaks the streaming protocol over real HTTP.

It is a raw ASGI app under uvicorn, in a thread and event loop of its own, so the adapter's SDK
client talks to it exactly as to the real service: ``POST /v1/messages`` with the key
(``x-api-key``, or ``Authorization: Bearer`` as the 2.x SDKs send it) and ``anthropic-version``,
answered by ``text/event-stream`` events (``message_start``, ``content_block_start`` /
``_delta`` / ``_stop``, ``ping``, ``message_delta``, ``message_stop``, ``error``) or by an HTTP
error with Anthropic's error body.

Tests script it with a queue of behaviours, one per accepted request (``text``, ``tool_use``,
``fail_status``, ``error_event_after``, ``truncate_after``, ``drop_after``, ``stall_after``); an
empty queue answers a short text. Like the real API it rejects malformed requests with a 400
(roles that do not alternate, a final assistant message ending in whitespace, empty text blocks,
``tool_use`` without its ``tool_result``), and such a rejection does not use up the script. Every
request is recorded (body, headers, status) with the moment a client left mid-stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Literal

import uvicorn

from tests.helpers import read_request

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Cut = Literal["error", "truncate", "drop", "stall"]

# The error ``type`` the real API sends with each status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_ids = itertools.count(1)


class _DropConnection(Exception):
    """Raised inside the app to make uvicorn close the socket mid-body (a dropped connection)."""


class _QuietDrops(logging.Filter):
    """Keeps uvicorn from logging the deliberate drops above as application errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[0] is _DropConnection)


_filter = _QuietDrops()


def words(n: int, start: int = 0) -> list[str]:
    """``n`` text deltas: ``"word0"``, ``" word1"``, ... (a leading space on all but the first)."""
    return [("" if i == 0 else " ") + f"word{i}" for i in range(start, start + n)]


@dataclasses.dataclass
class Block:
    """One content block of a scripted answer: text pieces, or a tool call's JSON pieces."""

    kind: Literal["text", "tool_use"]
    pieces: list[str]
    tool_id: str = ""
    name: str = ""


@dataclasses.dataclass
class Behaviour:
    """How the fake answers one request."""

    blocks: list[Block] = dataclasses.field(default_factory=list)
    stop_reason: str = "end_turn"
    input_tokens: int = 21
    output_tokens: int | None = None  # None: one per delta
    interval: float = 0.0  # seconds between deltas
    status: int = 200  # anything else: an HTTP error answer
    error_type: str | None = None
    message: str = ""
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    cut_after: int | None = None  # after this many content_block_delta events, do ``cut``
    cut: Cut = "truncate"


@dataclasses.dataclass
class Call:
    """One request as the fake saw it, and how its answer ended."""

    body: dict[str, Any]
    headers: dict[str, str]
    peer: str = ""  # the client's address and port: the same for calls on one connection
    status: int = 200
    deltas_sent: int = 0
    completed: bool = False  # the response body was ended by the fake
    disconnected_at: float | None = None  # time.monotonic() when the client left mid-answer

    @property
    def messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = self.body.get("messages", [])
        return messages


class FakeAnthropic:
    """The fake server; ``start()`` it, script it, read ``calls``, ``stop()`` it."""

    def __init__(self, *, api_key: str | None = None) -> None:
        self.api_key = api_key  # when set, other keys get a 401 like the real API
        self.calls: list[Call] = []
        self._script: collections.deque[Behaviour] = collections.deque()
        self._open: set[asyncio.Event] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # --- scripting -------------------------------------------------------------------------

    def push(self, behaviour: Behaviour) -> None:
        self._script.append(behaviour)

    def text(
        self,
        *pieces: str,
        input_tokens: int = 21,
        output_tokens: int | None = None,
        interval: float = 0.0,
        stop_reason: str = "end_turn",
    ) -> None:
        """A text answer made of ``pieces``, then its usage and ``message_stop``."""
        self.push(
            Behaviour(
                [Block("text", list(pieces))], stop_reason, input_tokens, output_tokens, interval
            )
        )

    def tool_use(
        self,
        name: str,
        argument_pieces: Iterable[str],
        *,
        tool_id: str = "toolu_01",
        text: Iterable[str] = (),
    ) -> None:
        """Optional text, then one ``tool_use`` block whose input arrives as JSON pieces."""
        blocks = [Block("text", list(text))] if text else []
        blocks.append(Block("tool_use", list(argument_pieces), tool_id, name))
        self.push(Behaviour(blocks, stop_reason="tool_use"))

    def fail_status(
        self,
        status: int,
        retry_after: str | None = None,
        *,
        error_type: str | None = None,
        message: str | None = None,
    ) -> None:
        """An HTTP error answer with Anthropic's error body (and ``retry-after`` if given)."""
        headers = {"retry-after": retry_after} if retry_after is not None else {}
        self.push(
            Behaviour(
                status=status,
                error_type=error_type,
                headers=headers,
                message=message or f"fake {status}",
            )
        )

    def _cut(self, cut: Cut, n: int, pieces: list[str] | None, interval: float) -> None:
        text = pieces if pieces is not None else words(n + 20)
        self.push(Behaviour([Block("text", text)], cut_after=n, cut=cut, interval=interval))

    def error_event_after(
        self, n: int, error_type: str = "overloaded_error", pieces: list[str] | None = None
    ) -> None:
        """``n`` text deltas, then ``event: error`` (e.g. ``overloaded_error``) and the end."""
        self._cut("error", n, pieces, 0.0)
        self._script[-1].error_type = error_type
        self._script[-1].message = "Overloaded" if error_type == "overloaded_error" else "fake"

    def truncate_after(self, n: int, pieces: list[str] | None = None) -> None:
        """``n`` text deltas, then a clean end of the body without ``message_stop``."""
        self._cut("truncate", n, pieces, 0.0)

    def drop_after(self, n: int, pieces: list[str] | None = None) -> None:
        """``n`` text deltas, then the socket is closed in the middle of the chunked body."""
        self._cut("drop", n, pieces, 0.0)

    def stall_after(self, n: int, pieces: list[str] | None = None) -> None:
        """``n`` text deltas, then silence until the client goes away."""
        self._cut("stall", n, pieces, 0.0)

    def slow(self, n: int, interval: float) -> None:
        """A text answer of ``n`` deltas, ``interval`` seconds apart."""
        self.text(*words(n), interval=interval)

    # --- running -----------------------------------------------------------------------------

    def start(self) -> FakeAnthropic:
        logging.getLogger("uvicorn.error").addFilter(_filter)
        config = uvicorn.Config(
            self._app,
            host="127.0.0.1",
            port=0,
            interface="asgi3",
            lifespan="off",
            log_config=None,
            timeout_graceful_shutdown=2,
        )
        server = uvicorn.Server(config)
        self._server = server
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(server.serve())
            finally:
                ready.set()
                loop.close()

        self._thread = threading.Thread(target=run, name="fake-anthropic", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if ready.is_set() or time.monotonic() > deadline:
                raise RuntimeError("the fake Anthropic server did not start")
            time.sleep(0.005)
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self._server is None or self._thread is None:
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._release)
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def _release(self) -> None:
        """End the stalls still waiting for their client (on the server's loop)."""
        for gone in self._open:
            gone.set()

    # --- the protocol --------------------------------------------------------------------------

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = await read_request(scope, receive)
        if request is None:
            return
        raw, headers = request
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
            problem: tuple[int, str] | None = (400, "the request body is not valid JSON")
        else:
            problem = None
        client = scope.get("client") or ("", 0)
        call = Call(body if isinstance(body, dict) else {}, headers, f"{client[0]}:{client[1]}")
        self.calls.append(call)
        if scope["method"] != "POST" or scope["path"] != "/v1/messages":
            problem = (404, f"no route for {scope['method']} {scope['path']}")
        problem = problem or _check_headers(headers, self.api_key) or _check_body(call.body)
        if problem is not None:
            await self._error(call, send, problem[0], None, problem[1], {})
            return
        behaviour = self._script.popleft() if self._script else Behaviour([Block("text", ["ok"])])
        if behaviour.status != 200:
            await self._error(
                call,
                send,
                behaviour.status,
                behaviour.error_type,
                behaviour.message,
                behaviour.headers,
            )
            return
        gone = asyncio.Event()
        self._open.add(gone)

        async def watch() -> None:
            # After the body, receive() returns only when the client has disconnected (or the
            # response completed, which the flag tells apart).
            while (await receive())["type"] != "http.disconnect":
                pass
            if not call.completed and call.disconnected_at is None:
                call.disconnected_at = time.monotonic()
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            await self._stream(call, behaviour, send, gone)
        finally:
            self._open.discard(gone)
            watcher.cancel()

    async def _error(
        self,
        call: Call,
        send: Send,
        status: int,
        error_type: str | None,
        message: str,
        extra: dict[str, str],
    ) -> None:
        call.status = status
        error = {"type": error_type or ERROR_TYPES.get(status, "api_error"), "message": message}
        payload = json.dumps({"type": "error", "error": error, "request_id": _request_id()})
        headers = [(b"content-type", b"application/json"), (b"request-id", _request_id().encode())]
        headers += [(k.encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload.encode(), "more_body": False})
        call.completed = True

    async def _stream(self, call: Call, b: Behaviour, send: Send, gone: asyncio.Event) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"request-id", _request_id().encode()),
                ],
            }
        )

        async def emit(event: str, data: dict[str, Any]) -> bool:
            """Send one event; False once the client is gone."""
            if gone.is_set():
                return False
            chunk = f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()
            try:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except OSError:
                return False
            return True

        async def end() -> None:
            call.completed = True
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def cut() -> None:
            if b.cut == "error":
                error = {"type": b.error_type or "overloaded_error", "message": b.message}
                if await emit("error", {"type": "error", "error": error}):
                    await end()
            elif b.cut == "truncate":
                await end()
            elif b.cut == "drop":
                raise _DropConnection()
            else:  # stall: silent until the client leaves (or the fake stops)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(gone.wait(), 60)

        model = str(call.body.get("model", ""))
        usage = {
            "input_tokens": b.input_tokens,
            "output_tokens": 1,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        start = {
            "type": "message_start",
            "message": {
                "id": f"msg_fake{next(_ids):06d}",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage,
            },
        }
        if not (await emit("message_start", start) and await emit("ping", {"type": "ping"})):
            return
        for index, block in enumerate(b.blocks):
            if block.kind == "text":
                content: dict[str, Any] = {"type": "text", "text": ""}
            else:
                content = {"type": "tool_use", "id": block.tool_id, "name": block.name, "input": {}}
            if not await emit(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": content},
            ):
                return
            for piece in block.pieces:
                if b.cut_after is not None and call.deltas_sent >= b.cut_after:
                    await cut()
                    return
                if b.interval and call.deltas_sent:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(gone.wait(), b.interval)
                if block.kind == "text":
                    delta = {"type": "text_delta", "text": piece}
                else:
                    delta = {"type": "input_json_delta", "partial_json": piece}
                if not await emit(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                ):
                    return
                call.deltas_sent += 1
            if not await emit("content_block_stop", {"type": "content_block_stop", "index": index}):
                return
        if b.cut_after is not None:
            await cut()
            return
        output = b.output_tokens if b.output_tokens is not None else max(1, call.deltas_sent)
        if await emit(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": b.stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": output},
            },
        ) and await emit("message_stop", {"type": "message_stop"}):
            await end()


def _request_id() -> str:
    return f"req_fake{next(_ids):06d}"


def _check_headers(headers: dict[str, str], api_key: str | None) -> tuple[int, str] | None:
    # The key comes as ``x-api-key`` or, from the 2.x SDKs, as ``Authorization: Bearer``.
    scheme, _, bearer = headers.get("authorization", "").partition(" ")
    sent = headers.get("x-api-key") or (bearer if scheme.lower() == "bearer" else None)
    if not sent:
        return 401, "x-api-key or authorization header is required"
    if api_key is not None and sent != api_key:
        return 401, "invalid x-api-key"
    if "anthropic-version" not in headers:
        return 400, "anthropic-version: header is required"
    return None


def _check_body(body: dict[str, Any]) -> tuple[int, str] | None:
    """The request checks of the real API that an adapter can get wrong."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        return 400, "model: Field required"
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        return 400, "max_tokens: Field required"
    if body.get("stream") is not True:
        return 400, "this fake only answers streaming requests"
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        return 400, "system: Input should be a valid string or list"
    for i, tool in enumerate(body.get("tools") or []):
        if "type" not in tool and not isinstance(tool.get("input_schema"), dict):
            return 400, f"tools.{i}.custom.input_schema: Field required"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return 400, "messages: at least one message is required"
    previous_role = None
    previous_tool_ids: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("user", "assistant"):
            return 400, f"messages.{i}.role: Input should be 'user' or 'assistant'"
        if role == previous_role:
            return 400, 'messages: roles must alternate between "user" and "assistant"'
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list) or not blocks:
            return 400, f"messages.{i}: all messages must have non-empty content"
        results = {b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"}
        if previous_tool_ids - results:
            missing = ", ".join(sorted(previous_tool_ids - results))
            return 400, (
                f"messages.{i}: `tool_use` ids were found without `tool_result` "
                f"blocks immediately after: {missing}"
            )
        if results - previous_tool_ids:
            return 400, f"messages.{i}: unexpected `tool_use_id` found in `tool_result` blocks"
        for block in blocks:
            if block.get("type") == "text" and not str(block.get("text", "")).strip():
                return 400, f"messages.{i}: text content blocks must contain non-whitespace text"
        previous_tool_ids = {str(b["id"]) for b in blocks if b.get("type") == "tool_use"}
        previous_role = role
    last = messages[-1]
    if last["role"] == "assistant":
        content = last["content"]
        tail = content if isinstance(content, str) else str(content[-1].get("text", "x"))
        if tail != tail.rstrip():
            return 400, "messages: final assistant content cannot end with trailing whitespace"
    return None
