"""Callers' shares, the body deadline and closes that finish, on real sockets: issue 34 §3, §8.

§3: with ``BROKER_MAX_CONNECTIONS=40``, forty bodies trickled by tenant ``a`` made every request
of tenant ``b`` get a 503, and nothing timed those bodies out. §8: 200 SSE readers that never
read were let go after the send timeout, yet their connections were all still ESTABLISHED 10 s
later (the close waited for the unsent bytes), and a few of 300 slowloris connections outlived
the header deadline. These tests run a real broker (uvicorn with the broker's protocol) in this
process and look at its sockets from both sides.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import bearer, start_turn, wait_until

KEY_A = "key-of-tenant-a-0123456789"
KEY_B = "key-of-tenant-b-0123456789"
KEYS = f"a={KEY_A},b={KEY_B}"
# The broker's time to notice and close, on a loaded two-core machine, past a deadline.
SLACK_S = 3.0
TCP_ESTABLISHED = 1  # tcpi_state, the first byte of TCP_INFO (Linux)


def address(broker: RunningBroker) -> tuple[str, int]:
    parts = urlsplit(broker.base_url)
    assert parts.hostname is not None
    assert parts.port is not None
    return parts.hostname, parts.port


def connect(broker: RunningBroker, source: str = "127.0.0.1", rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(address(broker))
    return sock


def answer(sock: socket.socket, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """The next response on ``sock`` (status, headers, body by Content-Length)."""
    received = b""
    deadline = time.monotonic() + timeout
    while True:
        head, sep, rest = received.partition(b"\r\n\r\n")
        if sep:
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])
            }
            if len(rest) >= int(headers.get("content-length", "0")):
                return int(lines[0].split(" ")[1]), headers, rest
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no whole answer in time: {received!r}"
        sock.settimeout(remaining)
        chunk = sock.recv(65_536)
        assert chunk, f"closed without a whole answer: {received!r}"
        received += chunk


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server ends the connection (an end of stream or a reset) within
    ``timeout``, reading and dropping what it sends before."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = max(0.0, deadline - time.monotonic())
        readable, _, _ = select.select([sock], [], [], remaining)
        if readable:
            try:
                if not sock.recv(65_536):
                    return True
            except OSError:
                return True
        elif time.monotonic() >= deadline:
            return False


def tcp_state(sock: socket.socket) -> int:
    """The connection's TCP state as the client's kernel sees it (without reading)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def server_sockets(port: int) -> int:
    """The descriptors of this process (the broker runs in it) on the server side of ``port``'s
    connections, the listening socket aside."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port == port and fields[3] != "0A":  # 0A: LISTEN
                    inodes.add(fields[9])
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        held += link.startswith("socket:[") and link[8:-1] in inodes
    return held


def trickled_post(key: str, length: int = 200) -> bytes:
    """A ``POST /v1/turns`` whose headers are whole and whose body has only begun."""
    return (
        b"POST /v1/turns HTTP/1.1\r\nHost: broker\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: %d\r\n\r\n{" % length
    )


def get(path: str, key: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return f"GET {path} HTTP/1.1\r\nHost: broker\r\n{auth}\r\n".encode()


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


# --- §3: a tenant's share, the body deadline ------------------------------------------------


def test_a_tenant_holding_its_whole_share_leaves_other_tenants_served(
    broker_factory: BrokerFactory, sockets: list[socket.socket]
) -> None:
    """Issue 34 §3: forty trickled bodies of tenant a got every request of tenant b a 503."""
    body_s = 4.0
    broker = broker_factory(
        api_keys=KEYS, max_connections=8, body_timeout_s=body_s, header_timeout_s=30.0
    )  # a tenant's share: 4 requests in flight
    # Tenant a trickles as many bodies as the process takes connections.
    trickling = [connect(broker) for _ in range(8)]
    sockets.extend(trickling)
    sent_at = time.monotonic()
    for sock in trickling:
        sock.sendall(trickled_post(KEY_A))

    def answered() -> list[socket.socket]:
        readable, _, _ = select.select(trickling, [], [], 0.05)
        return readable if len(readable) >= 4 else []

    refused = [answer(sock) for sock in wait_until(answered, timeout=body_s / 2)]
    assert len(refused) == 4, refused
    for status, headers, body in refused:
        assert status == 429
        assert orjson.loads(body)["error"]["code"] == "too_many_connections_for_caller"
        assert headers["retry-after"] == "1"
        assert headers["connection"] == "close"
    # Tenant b is served meanwhile, its stream read included.
    turn = start_turn(broker.base_url, "b-conv", auth=KEY_B, tokens=3)
    with httpx.stream(
        "GET",
        f"{broker.base_url}/v1/streams/{turn['stream_id']}",
        headers=bearer(KEY_B),
        timeout=10,
    ) as read:
        assert read.status_code == 200
        assert b"event: end" in read.read()
    # Tenant a's next request is refused while its share is held ...
    a_more = httpx.get(f"{broker.base_url}/v1/turns/nope", headers=bearer(KEY_A), timeout=10)
    assert a_more.status_code == 429
    assert a_more.headers["retry-after"] == "1"
    assert a_more.json()["error"]["code"] == "too_many_connections_for_caller"
    # ... until the body deadline answers the trickled bodies 408 and closes them.
    held = [sock for sock in trickling if tcp_state(sock) == TCP_ESTABLISHED]
    assert len(held) == 4
    for sock in held:
        status, _, body = answer(sock, timeout=body_s + SLACK_S)
        assert (status, orjson.loads(body)["error"]["code"]) == (408, "request_timeout")
        assert closed_by_server(sock, SLACK_S)
    assert time.monotonic() - sent_at >= body_s * 0.9
    after = httpx.get(f"{broker.base_url}/v1/turns/nope", headers=bearer(KEY_A), timeout=10)
    assert after.status_code == 404  # served: its share was given back
    assert broker.metric("broker_caller_refusals_total", '{cap="tenant"}') == 5
    closed = broker.metric("broker_http_connections_closed_total", '{reason="body_timeout"}')
    assert closed == len(held) == 4


def test_an_address_past_its_share_is_refused_and_other_addresses_are_not(
    broker_factory: BrokerFactory, sockets: list[socket.socket]
) -> None:
    broker = broker_factory(max_connections=8, uncapped_addresses="none")  # 2 per address
    idle = [connect(broker, "127.0.0.1") for _ in range(2)]
    sockets.extend(idle)
    over = connect(broker, "127.0.0.1")
    sockets.append(over)
    over.sendall(get("/healthz"))
    status, headers, body = answer(over)
    assert (status, orjson.loads(body)["error"]["code"]) == (429, "too_many_connections_for_caller")
    assert headers["retry-after"] == "1"
    assert closed_by_server(over, SLACK_S)
    other = connect(broker, "127.0.0.2")
    sockets.append(other)
    other.sendall(get("/healthz"))
    assert answer(other)[0] == 200
    idle[0].close()  # one goes: the address may open another
    wait_until(lambda: server_sockets(address(broker)[1]) == 2)
    again = connect(broker, "127.0.0.1")
    sockets.append(again)
    again.sendall(get("/healthz"))
    assert answer(again)[0] == 200
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3")) as client:
        metrics = client.get(f"{broker.base_url}/metrics").text
    assert 'broker_caller_refusals_total{cap="address"} 1.0' in metrics


# --- §8: readers that never read, slowloris ---------------------------------------------------


def test_readers_that_never_read_lose_their_connections_at_the_send_timeout(
    broker_factory: BrokerFactory, sockets: list[socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 34 §8: 200 readers let go after the send timeout were all ESTABLISHED 10 s later."""
    broker = broker_factory(sse_send_timeout_s=0.5, max_stream_events=200_000)
    port = address(broker)[1]
    turn = start_turn(broker.base_url, "stalled", tokens=100_000, tokens_per_s=0)
    let_go = "closing a stream whose client did not read"
    try:
        with caplog.at_level(logging.INFO, logger="broker.sse"):
            readers = [connect(broker, rcvbuf=4096) for _ in range(20)]
            sockets.extend(readers)
            for sock in readers:  # and never a byte read
                sock.sendall(get(f"/v1/streams/{turn['stream_id']}"))
            # Each reader's writes back up, and half a second later the broker lets it go ...
            wait_until(lambda: caplog.text.count(let_go) == 20, timeout=30)
        # ... and its connection is gone, from the client's side too (a close that waited
        # for the unsent bytes kept it ESTABLISHED), and its descriptor with it.
        wait_until(lambda: all(tcp_state(s) != TCP_ESTABLISHED for s in readers), SLACK_S)
        wait_until(lambda: server_sockets(port) == 0, timeout=SLACK_S)
        native = '{dialect="native",mode="sse"}'
        wait_until(lambda: broker.metric("broker_stream_viewers", native) == 0)
    finally:
        httpx.post(f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel", timeout=10)


def test_every_slowloris_connection_is_closed_at_the_header_deadline(
    broker_factory: BrokerFactory, sockets: list[socket.socket]
) -> None:
    """Issue 34 §8: 2 of 300 slowloris connections were still open after the header deadline."""
    header_s = 1.0
    broker = broker_factory(header_timeout_s=header_s)
    port = address(broker)[1]
    slow = [connect(broker) for _ in range(300)]
    sockets.extend(slow)
    opened = time.monotonic()
    line = get("/healthz?" + "x" * 100)
    # And one kept-alive connection that sends line ends only, which begin no request.
    kept = connect(broker)
    sockets.append(kept)
    kept.sendall(get("/healthz"))
    assert answer(kept)[0] == 200
    sent = 0
    open_ = [*slow, kept]
    deadline = opened + header_s + SLACK_S + 5
    while open_:
        assert time.monotonic() < deadline, f"{len(open_)} still open"
        for sock in list(open_):
            try:
                sock.send(b"\r\n" if sock is kept else line[sent : sent + 1])
            except OSError:
                open_.remove(sock)  # reset: closed
                continue
            if closed_by_server(sock, 0):
                open_.remove(sock)
        sent += 1
        time.sleep(0.1)
    assert time.monotonic() - opened < header_s + SLACK_S
    assert time.monotonic() - opened >= header_s * 0.9
    wait_until(lambda: server_sockets(port) == 0, timeout=SLACK_S)
