"""The broker's HTTP protocol without sockets: deadlines on a moved clock, and callers' shares.

Issue 34 §3: nothing timed out a request body once its headers were in (60 bodies trickled at a
byte every 2 s were all open after 40 s), and one tenant could take every connection of a
process. §8: bytes on a kept-alive connection (stray line ends, which start no request) cancelled
uvicorn's keep-alive timer and armed no deadline, and a close waited for ever on a client that
reads nothing. The protocol is fed bytes directly, its timers run when the test moves the clock,
and its transport records what it was asked to do.

Every test runs on both protocols: the fast path's and uvicorn's own behind the same limits
(``BROKER_FAST_PATH=off``, or a release that lost a name the fast path needs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.server import ServerState

from broker.api.limits import hold_share
from broker.errors import TooManyRequests
from broker.fastpath import (
    CLOSE_GRACE_S,
    ConnectionLimits,
    http_protocol_class,
    uncapped_addresses,
)
from broker.networks import parse_networks
from broker.settings import Settings, SettingsError

HEADER_S = 10.0
BODY_S = 30.0


@pytest.fixture(params=["fast", "stock"], autouse=True)
def protocol_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The protocol :class:`Server` builds: the fast one, or the stock one."""
    Server.fast = request.param == "fast"
    yield request.param
    Server.fast = True


class Timer:
    """A timer of :class:`Clock`."""

    def __init__(self, when: float, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.when, self.callback, self.args = when, callback, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Clock:
    """The protocol's loop: timers run when the test moves the clock; tasks run on the real
    loop."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[Timer] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Timer:
        timer = Timer(self.now + delay, callback, args)
        self.timers.append(timer)
        return timer

    def create_task(self, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        return asyncio.get_running_loop().create_task(coro, **kwargs)

    def advance(self, seconds: float) -> None:
        """Move the clock, running each timer that falls due, in order."""
        until = self.now + seconds
        while True:
            due = [t for t in self.timers if not t.cancelled and t.when <= until]
            if not due:
                break
            timer = min(due, key=lambda t: t.when)
            self.timers.remove(timer)
            self.now = timer.when
            timer.callback(*timer.args)
        self.now = until

    @property
    def armed(self) -> int:
        return sum(not t.cancelled for t in self.timers)


class Transport:
    """What the protocol asks of its connection, recorded."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.written = bytearray()
        self.closed = False
        self.aborted = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": (self.peer, 40_000), "sockname": ("10.9.9.9", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST``: reads the whole body; ``GET /tenant/<t>``: counts against ``t``, then holds
    the request until its connection goes; any other ``GET``: answered at once."""
    if scope["type"] != "http":
        return
    status, body = 200, b"ok"
    if scope["method"] == "POST":
        while True:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
    elif scope["path"].startswith("/tenant/"):
        try:
            hold_share(scope, scope["path"].rsplit("/", 1)[1])
        except TooManyRequests as exc:
            status, body = 429, orjson.dumps({"error": {"code": exc.code}})
        else:
            while (await receive())["type"] != "http.disconnect":
                pass
            return
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Server:
    """One protocol class (one server's limits and shares) and the clock of its connections."""

    fast = True  # the fast protocol, or the stock one (see protocol_kind)

    def __init__(self, **limits: Any) -> None:
        self.closed: list[str] = []  # metrics.CONNECTION_CLOSE_REASONS, as counted
        self.refused: list[str] = []  # metrics.CALLER_CAPS, as counted
        values: dict[str, Any] = {
            "header_timeout_s": HEADER_S,
            "max_header_bytes": 65_536,
            "max_connections": 100,
            "body_timeout_s": BODY_S,
            "count": self.closed.append,
            "refused": self.refused.append,
        }
        values.update(limits)
        self.limits = ConnectionLimits(**values)
        protocol = http_protocol_class(self.limits, fast=self.fast)
        self.config = uvicorn.Config(app, http=protocol, lifespan="off")
        self.config.load()
        self.state = ServerState()
        self.clock = Clock()

    def connect(self, peer: str = "10.0.0.1") -> tuple[Any, Transport]:
        protocol_class: Any = self.config.http_protocol_class
        protocol: Any = protocol_class(
            config=self.config, server_state=self.state, app_state={}, _loop=self.clock
        )
        transport = Transport(peer)
        protocol.connection_made(transport)
        return protocol, transport


async def settle() -> None:
    """Let the requests' tasks run until they wait."""
    for _ in range(20):
        await asyncio.sleep(0)


def answer(transport: Transport) -> tuple[int, bytes]:
    """The status and body of the first response written."""
    head, _, body = bytes(transport.written).partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def post(length: int) -> bytes:
    return b"POST /turns HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length


# --- §3: the body deadline -------------------------------------------------------------------


async def test_a_trickled_body_gets_a_408_at_the_body_deadline_and_the_connection_goes() -> None:
    """Issue 34 §3: a body trickled a byte at a time was never timed out."""
    server = Server()
    protocol, transport = server.connect()
    protocol.data_received(post(100) + b"{")
    await settle()
    for _ in range(int(BODY_S) - 1):  # a byte a second: never enough, always something
        server.clock.advance(1.0)
        protocol.data_received(b" ")
    await settle()
    assert not transport.closed
    assert transport.written == b""
    server.clock.advance(1.0)  # BODY_S after the headers' end
    status, body = answer(transport)
    assert (status, orjson.loads(body)["error"]["code"]) == (408, "request_timeout")
    assert b"connection: close" in transport.written
    assert transport.closed
    assert server.closed == ["body_timeout"]
    assert b"did not arrive within 30 s" in body


async def test_a_body_that_arrives_in_time_is_served_and_nothing_cuts_it_later() -> None:
    server = Server()
    protocol, transport = server.connect()
    protocol.data_received(post(10) + b"01234")
    server.clock.advance(BODY_S - 1)
    protocol.data_received(b"56789")
    await settle()
    assert answer(transport)[0] == 200
    server.clock.advance(BODY_S * 3)  # then idle: closed by uvicorn's keep-alive timer only
    assert transport.written.count(b"HTTP/1.1") == 1
    assert server.closed == []


async def test_a_request_without_a_body_arms_no_body_deadline() -> None:
    server = Server()
    protocol, transport = server.connect()
    protocol.data_received(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert protocol._deadline is None
    await settle()
    assert answer(transport)[0] == 200


async def test_a_body_still_coming_after_an_early_answer_is_cut_at_the_deadline_too() -> None:
    """An early answer (a 401) leaves the connection open while the body trickles on."""
    server = Server()
    protocol, transport = server.connect()
    protocol.data_received(b"GET /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    await settle()
    assert answer(transport)[0] == 200  # answered before its body
    server.clock.advance(BODY_S)
    assert transport.closed
    assert server.closed == ["body_timeout"]
    assert transport.written.count(b"HTTP/1.1") == 1  # no 408 after an answer


# --- §8: the header deadline on every connection, and closes that finish -------------------


async def test_stray_line_ends_on_a_kept_alive_connection_meet_the_header_deadline() -> None:
    """Issue 34 §8: a byte cancels uvicorn's keep-alive timer, and line ends begin no request
    for the parser: "\\r\\n" every few seconds held a connection for ever."""
    server = Server()
    protocol, transport = server.connect()
    protocol.data_received(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    assert answer(transport)[0] == 200
    protocol.data_received(b"\r\n")  # the next request's header clock starts here
    for _ in range(int(HEADER_S) - 1):
        server.clock.advance(1.0)
        protocol.data_received(b"\r\n")
    assert not transport.closed
    server.clock.advance(1.0)
    assert transport.closed
    assert server.closed == ["header_timeout"]


async def test_a_close_that_the_client_never_lets_finish_becomes_an_abort() -> None:
    server = Server()
    protocol, transport = server.connect()
    protocol.data_received(b"GET /x HTTP/1.1\r\nHo")
    server.clock.advance(HEADER_S)
    assert transport.closed
    assert not transport.aborted
    server.clock.advance(CLOSE_GRACE_S)  # it did not: the client reads nothing
    assert transport.aborted
    protocol.connection_lost(None)
    assert server.clock.armed == 0


async def test_a_close_that_finishes_is_not_aborted() -> None:
    server = Server()
    protocol, transport = server.connect()
    server.clock.advance(HEADER_S)  # a connection that sent nothing: closed unanswered
    assert transport.closed
    assert transport.written == b""
    protocol.connection_lost(None)
    server.clock.advance(CLOSE_GRACE_S * 2)
    assert not transport.aborted


# --- targets past httptools' URL parser ------------------------------------------------------


@pytest.mark.parametrize("split", [False, True])
async def test_a_target_past_the_url_parser_reaches_the_app_whole(split: bool) -> None:
    """Issue 14 §6: httptools' URL parser refuses a target past 64 KiB with a plain 400."""
    server = Server(max_header_bytes=200_000)
    seen: list[tuple[str, bytes]] = []

    async def record(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((scope["path"], scope["query_string"]))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    protocol, transport = server.connect()
    protocol.app = record
    request = b"GET /long%20one?q=" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    for part in (request[:30_000], request[30_000:]) if split else (request,):
        protocol.data_received(part)
    await settle()
    assert seen == [("/long one", b"q=" + b"a" * 70_000)]
    assert answer(transport)[0] == 204


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/turns HTTP/1.1\r\nHost: x\r\nContent-Length: \r\n\r\n",  # an empty length
        b"POST /v1/turns HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"GET /v1/healthz HTTP/9.9\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
    ],
    ids=["empty-length", "negative-length", "bad-version", "header-without-colon"],
)
async def test_bytes_that_are_not_http_get_the_brokers_json_400_and_the_close(
    request_bytes: bytes,
) -> None:
    """The parser's refusal answers in the broker's error shape, not uvicorn's plain text, on
    either protocol; the app never sees the request."""
    server = Server()
    seen: list[str] = []

    async def record(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["path"])

    protocol, transport = server.connect()
    protocol.app = record
    protocol.data_received(request_bytes)
    await settle()
    head, _, body = bytes(transport.written).partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 400 Bad Request"
    assert b"content-type: application/json" in head.lower()
    assert orjson.loads(body)["error"]["code"] == "bad_request"
    assert "not valid HTTP/1.1" in orjson.loads(body)["error"]["message"]
    assert seen == []
    assert server.closed == ["invalid_http"]
    server.clock.advance(60)  # (a close may linger to read what the client still sends)
    assert transport.closed


# --- §3: each caller's share ------------------------------------------------------------------


async def test_an_address_past_its_share_gets_a_429_and_other_addresses_do_not() -> None:
    server = Server(per_address=2, uncapped=uncapped_addresses(parse_networks("loopback")))
    first = [server.connect("10.0.0.1") for _ in range(2)]
    refused, refused_transport = server.connect("10.0.0.1")
    other, other_transport = server.connect("10.0.0.2")
    local = [server.connect("127.0.0.1") for _ in range(5)]  # loopback: uncapped
    for protocol, _ in [*first, (refused, refused_transport), (other, other_transport), *local]:
        protocol.data_received(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    status, body = answer(refused_transport)
    assert (status, orjson.loads(body)["error"]["code"]) == (429, "too_many_connections_for_caller")
    assert b"retry-after: 1" in refused_transport.written
    assert b"connection: close" in refused_transport.written
    assert server.refused == ["address"]
    for _, transport in [*first, (other, other_transport), *local]:
        assert answer(transport)[0] == 200
    # A tenth past the share (at least one), a new connection is closed unanswered.
    _, dropped = server.connect("10.0.0.1")
    assert dropped.closed
    assert dropped.written == b""
    assert server.closed == ["address_overflow"]
    # Each connection's count goes with it, however it went.
    for protocol, _ in [*first, (refused, refused_transport)]:
        protocol.connection_lost(None)
    assert server.limits.shares.addresses == {"10.0.0.1": 1, "10.0.0.2": 1}


@pytest.mark.parametrize(
    ("spec", "address", "uncapped"),
    [
        ("loopback", "127.0.0.1", True),
        ("loopback", "127.8.0.3", True),
        ("loopback", "::1", True),
        ("loopback", "::ffff:127.0.0.1", True),
        ("loopback", "10.0.0.1", False),
        ("none", "127.0.0.1", False),
        ("10.0.0.0/8, 192.168.1.7", "10.200.0.1", True),
        ("10.0.0.0/8, 192.168.1.7", "192.168.1.7", True),
        ("10.0.0.0/8, 192.168.1.7", "192.168.1.8", False),
        ("loopback", "not an address", False),
    ],
)
def test_which_addresses_are_uncapped(spec: str, address: str, uncapped: bool) -> None:
    assert uncapped_addresses(parse_networks(spec))(address) is uncapped


async def test_a_tenant_past_its_share_gets_a_429_and_others_are_served() -> None:
    server = Server(per_tenant=2)
    held = [server.connect() for _ in range(2)]
    for protocol, _ in held:
        protocol.data_received(b"GET /tenant/a HTTP/1.1\r\nHost: x\r\n\r\n")
    more, more_transport = server.connect()
    other, other_transport = server.connect()
    more.data_received(b"GET /tenant/a HTTP/1.1\r\nHost: x\r\n\r\n")
    other.data_received(b"GET /tenant/b HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    status, body = answer(more_transport)
    assert (status, orjson.loads(body)["error"]["code"]) == (429, "too_many_connections_for_caller")
    assert server.refused == ["tenant"]
    assert other_transport.written == b""  # served: tenant b's read goes on
    assert server.limits.shares.tenants == {"a": 2, "b": 1}
    # A held request that ends, any way it ends, gives its place back.
    held[0][0].connection_lost(None)
    other.connection_lost(ConnectionResetError())
    await settle()
    assert server.limits.shares.tenants == {"a": 1}
    again, again_transport = server.connect()
    again.data_received(b"GET /tenant/a HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    assert again_transport.written == b""  # counted, and held
    assert server.limits.shares.tenants == {"a": 2}
    for protocol, _ in [held[1], (again, again_transport), (more, more_transport)]:
        protocol.connection_lost(None)
    await settle()
    assert server.limits.shares.tenants == {}


async def test_a_completed_response_gives_its_place_back_on_a_kept_alive_connection() -> None:
    server = Server(per_tenant=1)

    async def quick(scope: Scope, receive: Receive, send: Send) -> None:
        hold_share(scope, "a")
        hold_share(scope, "a")  # a second look at the same caller counts once
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    protocol, transport = server.connect()
    protocol.app = quick
    for _ in range(3):  # one place, taken and given back by each request in turn
        protocol.data_received(b"GET /q HTTP/1.1\r\nHost: x\r\n\r\n")
        await settle()
    assert transport.written.count(b"HTTP/1.1 200") == 3
    assert server.limits.shares.tenants == {}
    assert server.refused == []


async def test_a_request_cancelled_mid_read_gives_its_place_back_with_its_connection() -> None:
    """The place does not wait on the request's task: a task that a cancellation never
    reached (redis-py can swallow one) still lets go when its connection goes."""
    server = Server(per_tenant=1)
    stuck = asyncio.Event()

    async def never_ends(scope: Scope, receive: Receive, send: Send) -> None:
        hold_share(scope, "a")
        while not stuck.is_set():
            try:
                await stuck.wait()
            except asyncio.CancelledError:
                continue  # swallowed, as a Redis call may

    protocol, _ = server.connect()
    protocol.app = never_ends
    protocol.data_received(b"GET /q HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    assert server.limits.shares.tenants == {"a": 1}
    protocol.connection_lost(None)
    assert server.limits.shares.tenants == {}
    stuck.set()


# --- settings -------------------------------------------------------------------------------


def test_the_share_settings_have_defaults_from_the_connection_cap() -> None:
    defaults = Settings()
    assert defaults.body_timeout_s == 30.0
    assert (defaults.address_share, defaults.tenant_share) == (2_500, 5_000)
    small = Settings(max_connections=40)
    assert (small.address_share, small.tenant_share) == (10, 20)
    tiny = Settings(max_connections=1)
    assert (tiny.address_share, tiny.tenant_share) == (1, 1)
    chosen = Settings.from_env(
        {
            "BROKER_BODY_TIMEOUT_S": "2.5",
            "BROKER_MAX_CONNECTIONS_PER_ADDRESS": "7",
            "BROKER_MAX_CONNECTIONS_PER_TENANT": "9",
            "BROKER_UNCAPPED_ADDRESSES": "none",
        }
    )
    assert (chosen.body_timeout_s, chosen.address_share, chosen.tenant_share) == (2.5, 7, 9)
    assert chosen.uncapped_networks == ()


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"body_timeout_s": 0}, "BROKER_BODY_TIMEOUT_S must be positive"),
        ({"body_timeout_s": float("nan")}, "BROKER_BODY_TIMEOUT_S must be a finite number"),
        ({"max_connections_per_address": -1}, "BROKER_MAX_CONNECTIONS_PER_ADDRESS must be 0"),
        ({"max_connections_per_tenant": -1}, "BROKER_MAX_CONNECTIONS_PER_TENANT must be 0"),
        ({"uncapped_addresses": "loopback,proxy"}, "BROKER_UNCAPPED_ADDRESSES must be"),
        ({"uncapped_addresses": "10.0.0.0/33"}, "BROKER_UNCAPPED_ADDRESSES must be"),
    ],
)
def test_bad_share_settings_stop_the_broker_with_one_line(
    values: dict[str, Any], named: str
) -> None:
    with pytest.raises(SettingsError, match=named):
        Settings(**values)
