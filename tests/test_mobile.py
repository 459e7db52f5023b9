"""The "Mobile clients" of docs/native.md, claim by claim.

* **A network change.** A phone that moves from Wi-Fi to mobile data keeps no connection: its
  old one goes silent, without a FIN or a reset, and it reconnects from a new address. Here a
  TCP proxy goes silent on every connection through it at once (it stops forwarding and keeps
  both sockets open, so the broker sees nothing) while new connections pass: the client notices
  the silence by its read timeout (heartbeats stopped), reconnects, and resumes from its last
  event id, with no gap and no duplicate. With a one-viewer attach token the new connection takes
  the token over although the broker still holds the old one, which it then lets go.
* **Battery.** A client may ask for heartbeats further apart (``?heartbeat=S``), within the
  broker's limits; a bad value is a 400.
* **Data and radio.** A client may let live events wait up to ``?batch_ms=`` to be sent together:
  far fewer writes, the same events in the same order, resumable as ever; a bad value is a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from broker_client import AttachPolicy, AttachStats, BrokerClient, TurnText
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import pings_and_gaps, read_sse, start_turn, text_of, wait_final, wait_until

HEARTBEAT_S = 0.3


class SilentProxy:
    """Forwards a loopback port to the broker; :meth:`go_silent` stops forwarding on every
    connection open now, sending nothing to either side, as a network path that vanished."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._upstream))
            silent = threading.Event()
            with self._lock:
                self._pairs.append((client, server, silent))
                self.accepted += 1
            for source, target in ((client, server), (server, client)):
                threading.Thread(
                    target=self._pipe, args=(source, target, silent), daemon=True
                ).start()

    @staticmethod
    def _pipe(source: socket.socket, target: socket.socket, silent: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65_536):
                if silent.is_set():
                    continue  # swallowed: the path is gone, and nobody is told
                target.sendall(data)
        if not silent.is_set():
            with contextlib.suppress(OSError):
                target.shutdown(socket.SHUT_WR)

    def go_silent(self) -> int:
        """Silence every connection open now; how many there were."""
        with self._lock:
            live = [pair for pair in self._pairs if not pair[2].is_set()]
            for _, _, silent in live:
                silent.set()
        return len(live)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for client, server, _ in self._pairs:
                for sock in (client, server):
                    with contextlib.suppress(OSError):
                        sock.close()


@pytest.fixture
def mobile_broker(broker_factory: BrokerFactory) -> RunningBroker:
    return broker_factory(sse_heartbeat_s=HEARTBEAT_S)


@pytest.fixture
def proxy(mobile_broker: RunningBroker) -> Iterator[SilentProxy]:
    port = int(mobile_broker.base_url.rsplit(":", 1)[1])
    proxy = SilentProxy(port)
    yield proxy
    proxy.close()


def read_through(proxy: SilentProxy, stream_id: str, token: str | None = None) -> Any:
    """Attach through the proxy; go silent once 10 events are in; read to the end."""
    policy = AttachPolicy(max_retries=20, base_delay=0.05, max_delay=0.3, read_timeout=1.5)

    async def run() -> tuple[list[str], TurnText, int, int]:
        ids: list[str] = []
        text = TurnText()
        silenced = 0
        stats = AttachStats()
        async with BrokerClient(f"http://127.0.0.1:{proxy.port}", policy=policy) as client:
            async for event in client.attach(stream_id, token=token, stats=stats):
                ids.append(event.id)
                text.feed(event)
                if len(ids) == 10:
                    silenced = proxy.go_silent()
        return ids, text, silenced, stats.reconnects

    return asyncio.run(asyncio.wait_for(run(), 60))


def test_after_a_network_change_the_client_resumes_from_a_new_connection(
    mobile_broker: RunningBroker, proxy: SilentProxy
) -> None:
    turn = start_turn(mobile_broker.base_url, "phone", tokens=60, tokens_per_s=40)
    ids, text, silenced, reconnects = read_through(proxy, turn["stream_id"])
    assert silenced == 1, "the read was not on one connection when the path went silent"
    assert 1 <= reconnects <= 2, reconnects
    assert proxy.accepted == 1 + reconnects
    assert ids == sorted(set(ids)), "an event came twice or out of order"
    stored = read_sse(mobile_broker.base_url, turn["stream_id"]).events
    assert ids == [e.id for e in stored], "a gap: the resumed read missed events"
    assert text.text == text_of(stored)
    assert text.status == "complete"


def test_after_a_network_change_a_one_viewer_token_is_taken_over_by_the_new_connection(
    mobile_broker: RunningBroker, proxy: SilentProxy
) -> None:
    broker = mobile_broker
    # Long enough that the old connection would hold the token for seconds after the change.
    turn = start_turn(broker.base_url, "phone-1v", tokens=200, tokens_per_s=40)
    minted = httpx.post(
        f"{broker.base_url}/v1/turns/{turn['turn_id']}/attach-tokens",
        json={"one_viewer": True},
        timeout=10,
    )
    assert minted.status_code == 201, minted.text
    token = minted.json()["token"]
    ids, text, silenced, reconnects = read_through(proxy, turn["stream_id"], token=token)
    assert silenced == 1
    # Admitted at once, not after waiting for the broker to give up the old connection.
    assert 1 <= reconnects <= 2, reconnects
    stored = read_sse(broker.base_url, turn["stream_id"]).events
    assert ids == [e.id for e in stored]
    assert text.status == "complete"
    # The old connection, alive as far as the broker knew, was let go: no viewer is left.
    metrics = f"{broker.base_url}/metrics"
    native = 'broker_stream_viewers{dialect="native",mode="sse"} 0.0'
    wait_until(
        lambda: native in httpx.get(metrics, timeout=5).text,
        timeout=10,
    )


def test_a_client_may_space_heartbeats_further_apart_within_limits(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(sse_heartbeat_s=0.2, sse_heartbeat_max_s=5)
    turn = start_turn(broker.base_url, "battery", tokens=10, tokens_per_s=0, stall_after_deltas=2)
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    wait_until(lambda: len(httpx.get(url, params={"format": "json"}, timeout=5).json()["events"]))
    asked = pings_and_gaps(broker.base_url, turn["stream_id"], {"heartbeat": "1"})
    assert min(asked) >= 0.9, f"heartbeats {asked} came faster than the 1 s asked"
    for bad in ("0", "6", "1.5", "soon"):
        response = httpx.get(url, params={"heartbeat": bad}, timeout=10)
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["code"] == "bad_heartbeat"
        assert "from 0.2 to 5" in response.json()["error"]["message"]
    json_read = httpx.get(url, params={"heartbeat": "1", "format": "json"}, timeout=10)
    assert json_read.status_code == 400
    assert "SSE reads only" in json_read.json()["error"]["message"]
    wait_final_or_cancel(broker, turn)


def wait_final_or_cancel(broker: RunningBroker, turn: dict[str, Any]) -> None:
    httpx.post(f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel", timeout=10)
    wait_final(broker.base_url, turn["turn_id"])


def chunked_writes(port: int, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """The body writes of an HTTP/1.1 chunked response (one chunk is one write of the server),
    and the body, read with a bare socket to its end."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n"
    buffer, body, writes = b"", b"", 0
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(request.encode())

        def fill(need: bytes | int) -> None:
            nonlocal buffer
            while (need not in buffer) if isinstance(need, bytes) else (len(buffer) < need):
                data = sock.recv(65_536)
                assert data, "the broker closed the connection mid-response"
                buffer += data

        fill(b"\r\n\r\n")
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding: chunked" in head.lower(), head
        while True:
            fill(b"\r\n")
            size_line, _, buffer = buffer.partition(b"\r\n")
            size = int(size_line, 16)
            fill(size + 2)
            if size == 0:
                return writes, body
            writes += 1
            body, buffer = body + buffer[:size], buffer[size + 2 :]


def test_a_client_may_let_live_events_wait_to_be_sent_together(
    broker_factory: BrokerFactory,
) -> None:
    # No append linger: each delta is an append of its own, and a write of its own unbatched.
    broker = broker_factory(append_linger_ms=0)
    turn = start_turn(
        broker.base_url, "batched", tokens=40, tokens_per_s=20, first_delta_after_ms=500
    )
    path = f"/v1/streams/{turn['stream_id']}"
    port = int(broker.base_url.rsplit(":", 1)[1])
    plain: list[tuple[int, bytes]] = []
    batched: list[tuple[int, bytes]] = []
    readers = [
        threading.Thread(target=lambda: plain.append(chunked_writes(port, path, {}))),
        threading.Thread(
            target=lambda: batched.append(chunked_writes(port, f"{path}?batch_ms=500", {}))
        ),
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=30)
    (plain_writes, plain_body), (batched_writes, batched_body) = plain[0], batched[0]
    # The same frames, byte for byte, in far fewer writes: 40 deltas 50 ms apart (2 s) in
    # 500 ms windows, about 4 writes and the opening and the end, where the plain reader writes
    # about one per delta (a loaded machine may hand it a few deltas at once, never most).
    assert batched_body == plain_body
    assert b"event: end" in batched_body
    assert batched_writes <= 9, (batched_writes, plain_writes)
    assert plain_writes >= 2 * batched_writes, (plain_writes, batched_writes)
    # Resumable as ever: from the middle, the rest, no gap and no duplicate.
    whole = read_sse(broker.base_url, turn["stream_id"])
    middle = whole.events[len(whole.events) // 2]
    url = f"{broker.base_url}{path}"
    with httpx.stream(
        "GET", url, params={"batch_ms": "300"}, headers={"Last-Event-ID": middle.id}, timeout=20
    ) as response:
        rest = response.read().decode()
    rest_ids = [line[4:] for line in rest.split("\n") if line.startswith("id: ")]
    assert rest_ids == [event.id for event in whole.events[len(whole.events) // 2 + 1 :]]


def test_a_bad_batch_is_a_400(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, "batched-bad", tokens=3, tokens_per_s=0)
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    for params in (
        {"batch_ms": "1001"},
        {"batch_ms": "-1"},
        {"batch_ms": "0.5"},
        {"batch_ms": "soon"},
        {"batch_ms": "10", "format": "json"},
    ):
        response = httpx.get(url, params=params, timeout=10)
        assert response.status_code == 400, (params, response.text)
        assert response.json()["error"]["code"] == "bad_batch"
    assert httpx.get(url, params={"batch_ms": "0"}, timeout=10).status_code == 200
