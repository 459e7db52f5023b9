"""The connection's wire (``broker.sse.WIRE``): event-stream writes past ASGI, on a real uvicorn.

The broker's HTTP protocol offers each request a write that frames a body chunk and hands it to
the transport at once, and a call when the connection is lost. These tests serve a small ASGI
app with that protocol on a real socket and check what a client receives: the framing, the
order against ASGI's own sends, the refusal once the client stops reading (the caller then
waits in ``send``, and nothing is lost or reordered), and the call on a lost connection.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from broker.fastpath import UNSENT_LIMIT, ConnectionLimits
from broker.fastpath.http_protocol import fast_protocol
from broker.fastpath.wire import ConnectionWire, LazyEvent
from broker.sse import WIRE, Wire
from tests.helpers import wait_until

START = {"type": "http.response.start", "status": 200, "headers": [(b"x-test", b"wire")]}


@dataclass
class Served:
    """What the app saw, for the test to look at (written on the server's thread)."""

    base_url: str
    refused: list[int] = field(default_factory=list)  # indexes of the writes the wire refused
    lost: threading.Event = field(default_factory=threading.Event)
    lost_late: threading.Event = field(default_factory=threading.Event)
    wires: list[Wire | None] = field(default_factory=list)
    protocols: list[weakref.ref[Any]] = field(default_factory=list)  # each request's connection
    done: threading.Event = field(default_factory=threading.Event)
    writes: list[bytes] = field(default_factory=list)  # a /started response's transport writes
    started: list[bool] = field(default_factory=list)  # what each wire.start answered


def chunk(index: int, size: int = 100) -> bytes:
    return f"{index:08d}".encode().ljust(size, b".")


def make_app(served: Served) -> Callable[[Scope, Receive, Send], Any]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        wire: Wire | None = scope.get(WIRE)
        served.wires.append(wire)
        if isinstance(wire, ConnectionWire) and wire._protocol is not None:
            served.protocols.append(weakref.ref(wire._protocol))
        path = scope["path"]
        if path == "/sized":  # a body with a length: not chunked, the wire declines
            await send({**START, "headers": [(b"content-length", b"2")]})
            assert wire is not None
            if wire.write(b"no"):
                served.refused.append(-1)  # (wrong: the test sees it)
            await send({"type": "http.response.body", "body": b"ok"})
            return
        assert wire is not None
        if path.startswith("/started/"):  # the head held with the writes that follow it
            assert isinstance(wire, ConnectionWire)
            assert wire._cycle is not None
            wire._cycle.transport = _Counted(wire._cycle.transport, served.writes)  # type: ignore[assignment]
            if path.endswith("/sized"):
                await wire.start(send, {**START, "headers": [(b"content-length", b"5")]})
                served.started.append(wire.write(b"first"))  # declined: not chunked
                await send({"type": "http.response.body", "body": b"first"})
            else:
                await wire.start(send, START)
                size = 1_000 if path.endswith("/many") else 8
                count = 40 if path.endswith("/many") else 2
                served.started.append(all(wire.write(chunk(i, size)) for i in range(count)))
                await asyncio.sleep(0)  # the loop's next turn: what was held is written
                served.started.append(wire.write(b"later"))
                wire.flush()  # (nothing held now)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            served.done.set()
            return
        await send(START)
        if path == "/mixed":  # wire writes and ASGI sends, alternating
            for i in range(200):
                if i % 3 == 0:
                    await send({"type": "http.response.body", "body": chunk(i), "more_body": True})
                elif not wire.write(chunk(i)):
                    served.refused.append(i)
                    await send({"type": "http.response.body", "body": chunk(i), "more_body": True})
        elif path.startswith("/flood/"):  # a client that stops reading: the wire refuses
            count = int(path.rsplit("/", 1)[1])
            for i in range(count):
                if not wire.write(chunk(i, 4096)):
                    served.refused.append(i)
                    await send(
                        {"type": "http.response.body", "body": chunk(i, 4096), "more_body": True}
                    )
        elif path.startswith("/echo/"):  # a short body that names the request
            body = path.encode()
            await send({"type": "http.response.body", "body": body, "more_body": False})
            served.done.set()
            return
        elif path == "/lost":  # held open until the client leaves
            left = asyncio.Event()

            def lost() -> None:
                left.set()
                served.lost.set()

            wire.when_lost(lost)
            await left.wait()
            wire.when_lost(served.lost_late.set)  # after the loss: called at once
            served.done.set()
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        served.done.set()

    return app


class _Counted:
    """A transport whose writes are recorded in ``writes``, then made."""

    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


@pytest.fixture
def served() -> Iterator[Served]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    served = Served(base_url=f"http://127.0.0.1:{port}")
    limits = ConnectionLimits(header_timeout_s=10, max_header_bytes=65_536, max_connections=100)
    config = uvicorn.Config(
        make_app(served), http=fast_protocol(limits), lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    try:
        yield served
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_wire_writes_and_asgi_sends_arrive_framed_and_in_order(served: Served) -> None:
    response = httpx.get(f"{served.base_url}/mixed", timeout=10)
    assert response.status_code == 200
    assert response.headers["x-test"] == "wire"
    assert response.headers["transfer-encoding"] == "chunked"
    assert response.content == b"".join(chunk(i) for i in range(200))
    assert served.refused == []  # a client that reads: every wire write went at once


def test_the_wire_refuses_once_the_client_stops_reading_and_nothing_is_lost(
    served: Served,
) -> None:
    count = 1_000  # 4 MiB: far past what the kernel and the transport hold for a silent client
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65_536)  # before the handshake
        sock.connect(("127.0.0.1", int(served.base_url.rsplit(":", 1)[1])))
        sock.sendall(b"GET /flood/%d HTTP/1.1\r\nHost: x\r\n\r\n" % count)
        wait_until(lambda: len(served.refused) > 0, timeout=10)  # the client reads nothing yet
        first_refused = served.refused[0]
        assert first_refused < count // 2
        received = bytearray()
        sock.settimeout(10)
        while not received.endswith(b"0\r\n\r\n"):
            data = sock.recv(1 << 16)
            assert data, "closed before the end of the body"
            received += data
    assert served.done.wait(5)
    body = _unchunk(bytes(received).partition(b"\r\n\r\n")[2])
    assert body == b"".join(chunk(i, 4096) for i in range(count))


def test_the_head_and_the_chunks_right_after_it_go_in_one_write(served: Served) -> None:
    """An event stream's head, opening frame and the replay at hand: one write per attach."""
    response = httpx.get(f"{served.base_url}/started/chunked", timeout=10)
    assert response.status_code == 200
    assert response.headers["x-test"] == "wire"  # uvicorn's head, as its send makes it
    assert response.headers["transfer-encoding"] == "chunked"
    assert response.content == chunk(0, 8) + chunk(1, 8) + b"later"
    assert served.started == [True, True]
    head, _, first = served.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert first == b"".join(b"8\r\n%b\r\n" % chunk(i, 8) for i in range(2))
    assert served.writes[1:] == [b"5\r\nlater\r\n", b"0\r\n\r\n"]  # then each at once


def test_what_the_wire_holds_after_the_head_is_bounded(served: Served) -> None:
    """The wire holds no more than the connection's unsent bound: past it, it writes."""
    response = httpx.get(f"{served.base_url}/started/many", timeout=10)
    assert response.content == b"".join(chunk(i, 1_000) for i in range(40)) + b"later"
    assert served.started == [True, True]
    assert served.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert all(len(write) < UNSENT_LIMIT + 1_100 for write in served.writes)
    assert len(served.writes) >= 40 * 1_000 // (UNSENT_LIMIT + 1_100) + 2


def test_a_start_with_a_length_writes_the_head_alone(served: Served) -> None:
    """A body that is not chunked is never framed by the wire: its head goes alone, at once,
    and the body through uvicorn's send."""
    response = httpx.get(f"{served.base_url}/started/sized", timeout=10)
    assert response.status_code == 200
    assert response.content == b"first"
    assert served.started == [False]
    assert served.writes[0].endswith(b"\r\n\r\n")  # the head alone
    assert served.writes[1:] == [b"first"]


def test_a_body_with_a_length_is_never_written_by_the_wire(served: Served) -> None:
    response = httpx.get(f"{served.base_url}/sized", timeout=10)
    assert response.content == b"ok"
    assert served.refused == []  # the wire declined the write


def test_the_wire_calls_back_when_the_connection_is_lost_and_at_once_after(
    served: Served,
) -> None:
    with socket.create_connection(("127.0.0.1", int(served.base_url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"GET /lost HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
        assert not served.lost.is_set()
    assert served.lost.wait(5)
    assert served.lost_late.wait(5)
    assert served.done.wait(5)


def test_a_lost_connection_is_freed_without_the_garbage_collector(served: Served) -> None:
    """Regression: the wire in a request's scope held the protocol, which held the scope, so a
    departed client's connection waited for the collector's next full pass (about 4 KiB each,
    40 MB after ten thousand readers left a quiet broker, where that pass rarely comes)."""
    gc.disable()
    try:
        port = int(served.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /lost HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(10)
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
            assert served.protocols[-1]() is not None
        assert served.done.wait(5)
        wait_until(lambda: served.protocols[-1]() is None, timeout=5)
    finally:
        gc.enable()


def test_every_http_request_is_offered_a_wire_of_its_own(served: Served) -> None:
    with httpx.Client(base_url=served.base_url, timeout=10) as client:  # one kept-alive socket
        for _ in range(3):
            assert client.get("/mixed").status_code == 200
    wires = [w for w in served.wires if w is not None]
    assert len(wires) == 3
    assert len({id(w) for w in wires}) == 3


def _unchunk(data: bytes) -> bytes:
    """A chunked body's bytes (asserting its framing is whole)."""
    out = bytearray()
    while True:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n"
            return bytes(out)
        out += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        data = rest[size + 2 :]


def test_a_wire_forgets_only_its_own_callback() -> None:
    """A response that ends after the next request's began must not unhook the next one."""
    protocol: Any = SimpleNamespace(lost=False, on_lost=None)
    cycle: Any = SimpleNamespace(disconnected=False)
    calls: list[str] = []
    earlier, later = ConnectionWire(protocol, cycle), ConnectionWire(protocol, cycle)
    earlier.when_lost(lambda: calls.append("earlier"))
    later.when_lost(lambda: calls.append("later"))
    earlier.when_lost(None)
    assert protocol.on_lost is not None
    protocol.on_lost()
    assert calls == ["later"]
    later.when_lost(None)
    assert protocol.on_lost is None


def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    """The protocol keeps uvicorn's queue of pipelined requests in a list of its own."""
    port = int(served.base_url.rsplit(":", 1)[1])
    requests = b"".join(f"GET /echo/{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in range(5))
    received = b""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(requests)  # all five before the first answer
        sock.settimeout(10)
        while received.count(b"0\r\n\r\n") < 5:
            data = sock.recv(65_536)
            assert data, received
            received += data
    bodies = [
        _unchunk(part.partition(b"\r\n\r\n")[2] + b"0\r\n\r\n")
        for part in received.split(b"0\r\n\r\n")[:5]
    ]
    assert bodies == [f"/echo/{i}".encode() for i in range(5)]


async def test_a_lazy_event_waits_sets_and_clears_as_asyncio_s() -> None:
    event = LazyEvent()
    assert not event.is_set()
    assert event._event is None  # nothing held until a wait
    waiters = [asyncio.create_task(event.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    event.set()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == [True, True, True]
    event.clear()
    late = asyncio.create_task(event.wait())
    await asyncio.sleep(0)
    assert not late.done()
    event.set()
    assert await asyncio.wait_for(late, 5) is True
    assert await LazyEvent(is_set=True).wait() is True  # set from the start: no wait


def test_the_protocol_keeps_its_instance_dictionary_small() -> None:
    """Past 30 keys an instance dictionary stops sharing its keys with the class's other
    instances and takes 1.6 KiB instead of 0.3, for each of thousands of connections: the
    protocol's own state lives in slots, beside uvicorn's 28 attributes."""
    limits = ConnectionLimits(header_timeout_s=10, max_header_bytes=65_536, max_connections=100)
    config = uvicorn.Config(make_app(Served("")), lifespan="off")
    config.load()
    loop = asyncio.new_event_loop()
    try:
        protocol = fast_protocol(limits)(config, uvicorn.server.ServerState(), {}, loop)
        protocol.url = b""  # set by uvicorn as each request begins
        assert len(protocol.__dict__) <= 30, sorted(protocol.__dict__)
    finally:
        loop.close()
