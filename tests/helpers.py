"""Small, independent helpers for talking to a broker in tests (no client package needed)."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import httpx
import orjson
import pytest


@dataclasses.dataclass(frozen=True)
class SSEEvent:
    id: str
    event: str
    data: dict[str, Any]


@dataclasses.dataclass
class Read:
    """What one SSE read saw."""

    events: list[SSEEvent]
    retry: int | None
    comments: int
    last_id: str | None
    ended_by_server: bool
    headers: httpx.Headers


def read_sse(
    base_url: str,
    stream_id: str,
    *,
    offset: str | None = None,
    last_event_id: str | None = None,
    stop_after: int | None = None,
    timeout: float = 15.0,
    token: str | None = None,
    auth: str | None = None,
) -> Read:
    """Read a stream; with ``stop_after`` the client hangs up after that many events.

    ``token`` is sent as ``?token=`` (an attach token), ``auth`` as a bearer credential.
    """
    params = {"offset": offset} if offset is not None else {}
    if token is not None:
        params["token"] = token
    headers = {"Accept": "text/event-stream", **bearer(auth)}
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    events: list[SSEEvent] = []
    retry: int | None = None
    comments = 0
    last_id: str | None = None
    fields: dict[str, str] = {}
    data: list[str] = []
    deadline = time.monotonic() + timeout
    with httpx.stream(
        "GET",
        f"{base_url}/v1/streams/{stream_id}",
        params=params,
        headers=headers,
        timeout=httpx.Timeout(timeout),
    ) as response:
        if response.status_code == 204:  # at rest, nothing after the resume point
            return Read([], None, 0, None, True, response.headers)
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            assert time.monotonic() < deadline, "stream read took too long"
            if line == "":
                if "id" in fields:
                    last_id = fields["id"]
                # A resume_point event moves the resume point; it is not one of the stream's.
                if data and fields.get("event") != "resume_point":
                    events.append(
                        SSEEvent(
                            fields.get("id", ""),
                            fields.get("event", "message"),
                            orjson.loads("\n".join(data)),
                        )
                    )
                fields, data = {}, []
                if stop_after is not None and len(events) >= stop_after:
                    return Read(events, retry, comments, last_id, False, response.headers)
                continue
            if line.startswith(":"):
                comments += 1
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            elif name == "retry":
                retry = int(value)
            else:
                fields[name] = value
        return Read(events, retry, comments, last_id, True, response.headers)


def start_turn(
    base_url: str,
    conversation_id: str = "conv-1",
    *,
    turn_id: str | None = None,
    prompt: str = "Tell me about streams",
    expect: int | tuple[int, ...] = (200, 201),
    auth: str | None = None,
    **simulate: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "conversation_id": conversation_id,
        "messages": [{"role": "user", "content": prompt}],
        "params": {"simulate": simulate},
    }
    if turn_id is not None:
        body["turn_id"] = turn_id
    response = httpx.post(f"{base_url}/v1/turns", json=body, headers=bearer(auth), timeout=10)
    allowed = (expect,) if isinstance(expect, int) else expect
    assert response.status_code in allowed, response.text
    turn: dict[str, Any] = response.json()
    return turn


def text_of(events: list[SSEEvent]) -> str:
    return "".join(str(e.data["text"]) for e in events if e.event == "delta")


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def bearer(credential: str | None) -> dict[str, str]:
    """The ``Authorization`` header for an API key or token (none for ``None``)."""
    return {} if credential is None else {"Authorization": f"Bearer {credential}"}


def get_turn(base_url: str, turn_id: str, auth: str | None = None) -> dict[str, Any]:
    response = httpx.get(f"{base_url}/v1/turns/{turn_id}", headers=bearer(auth), timeout=10)
    assert response.status_code == 200, response.text
    turn: dict[str, Any] = response.json()
    return turn


def wait_final(
    base_url: str, turn_id: str, timeout: float = 15.0, auth: str | None = None
) -> dict[str, Any]:
    final = ("complete", "interrupted", "cancelled", "failed", "requires_action")
    turn: dict[str, Any] = wait_until(
        lambda: (t := get_turn(base_url, turn_id, auth))["status"] in final and t, timeout
    )
    return turn


class ToolEndpoint:
    """A real HTTP tool endpoint on loopback: it records each call (its ``Idempotency-Key`` and
    ``Broker-Tenant`` headers and JSON body) and answers with ``reply(number_of_calls_so_far)``."""

    def __init__(self, path: str, reply: Callable[[int], Any]) -> None:
        self.requests: list[dict[str, Any]] = []
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = orjson.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.requests.append(
                    {
                        "key": self.headers.get("Idempotency-Key"),
                        "tenant": self.headers.get("Broker-Tenant"),
                        "body": body,
                    }
                )
                answer = orjson.dumps(reply(len(endpoint.requests)))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def bodies(self) -> list[Any]:
        return [request["body"] for request in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def read_request(scope: Any, receive: Any) -> tuple[bytes, dict[str, str]] | None:
    """The whole body and the lower-cased headers of an ASGI request (None: client left)."""
    raw = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        raw += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    return bytes(raw), headers


def missing_tool(reason: str, *, module: bool = False) -> NoReturn:
    """Skip a test whose tool is absent on a developer's machine; in CI (which installs every
    tool) a missing one is a failure, so no check there can silently not run."""
    import os

    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must provide it)", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


def wait_for_deltas(url: str, count: int) -> None:
    """Wait until the stream at ``url`` (a ``/v1/streams/{id}`` URL) holds ``count`` deltas."""

    def stored() -> int:
        page = httpx.get(url, params={"format": "json"}, timeout=5).json()
        return sum(event["event"] == "delta" for event in page["events"])

    wait_until(lambda: stored() == count)


def pings_and_gaps(base_url: str, stream_id: str, params: dict[str, str]) -> list[float]:
    """The times between the first heartbeats of a quiet stream (3 gaps)."""
    seen: list[float] = []
    url = f"{base_url}/v1/streams/{stream_id}"
    with httpx.stream("GET", url, params=params, timeout=20) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(":"):
                seen.append(time.monotonic())
                if len(seen) == 4:
                    break
    return [later - earlier for earlier, later in itertools.pairwise(seen)]


@contextlib.contextmanager
def answers_at_full_speed() -> Iterator[None]:
    """The simulated model's default pace made none (it is 25 deltas/s) while the block runs,
    for an in-process broker whose requests cannot ask for a pace (a fuzzer's generated ones):
    otherwise every blocking create waits out a two-second answer."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("broker.providers.simulated.DEFAULT_TOKENS_PER_S", 0.0)
        yield
