"""Deltas that arrive while an append is in flight share the next append; nothing else changes."""

from __future__ import annotations

import httpx

from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import get_turn, read_sse, start_turn, text_of, wait_final, wait_until


def appends(broker: RunningBroker) -> float:
    return broker.metric("broker_append_seconds_count")


def test_a_fast_answer_takes_fewer_appends_than_deltas_and_reads_the_same(
    broker: RunningBroker,
) -> None:
    before = appends(broker)
    fast = start_turn(broker.base_url, "c", prompt="same", tokens=600, tokens_per_s=0, seed=7)
    assert wait_final(broker.base_url, fast["turn_id"])["status"] == "complete"
    used = appends(broker) - before
    paced = start_turn(broker.base_url, "d", prompt="same", tokens=600, tokens_per_s=5000, seed=7)
    assert wait_final(broker.base_url, paced["turn_id"])["status"] == "complete"
    fast_events = read_sse(broker.base_url, fast["stream_id"]).events
    paced_events = read_sse(broker.base_url, paced["stream_id"]).events
    assert [e.event for e in fast_events] == [e.event for e in paced_events]
    assert text_of(fast_events) == text_of(paced_events)
    assert len([e for e in fast_events if e.event == "delta"]) == 600
    assert used < 600 / 4, used  # deltas went in groups
    ids = [e.id for e in fast_events]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert get_turn(broker.base_url, fast["turn_id"])["canonical"]["text"] == text_of(fast_events)


def test_a_stop_during_grouped_appends_keeps_text_and_stream_in_step(
    broker_factory: BrokerFactory,
) -> None:
    # Room for a long answer: the stop must land mid-answer, not race the stream's limit
    # (at full speed 20,000 events, the default, take well under a second on a busy machine).
    broker = broker_factory(max_stream_events=150_000)
    for n in range(5):
        turn = start_turn(broker.base_url, f"c{n}", tokens=100_000, tokens_per_s=0, seed=n)
        stream_id = turn["stream_id"]
        assert read_sse(broker.base_url, stream_id, stop_after=20, timeout=10).events
        response = httpx.post(f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel", timeout=10)
        assert response.status_code == 200
        final = wait_final(broker.base_url, turn["turn_id"])
        assert final["status"] == "cancelled"
        events = read_sse(broker.base_url, turn["stream_id"]).events
        assert events[-1].event == "end"
        assert events[-1].data["status"] == "cancelled"
        # The stored answer is exactly what readers got: no queued delta counted unwritten.
        assert final["canonical"]["text"] == text_of(events)


def test_a_reader_that_stops_reading_is_let_go_after_the_send_timeout(
    broker_factory: BrokerFactory,
) -> None:
    import socket
    from urllib.parse import urlparse

    broker = broker_factory(sse_send_timeout_s=0.5, max_stream_events=200_000)
    turn = start_turn(broker.base_url, "c", tokens=100_000, tokens_per_s=0)
    url = urlparse(broker.base_url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        request = f"GET /v1/streams/{turn['stream_id']} HTTP/1.1\r\nHost: x\r\n\r\n"
        sock.sendall(request.encode())

        def viewers() -> float:
            return broker.metric("broker_stream_viewers", '{mode="sse"}')

        wait_until(lambda: viewers() == 1, timeout=10)
        # Never read: the broker's writes back up (8 MB is more than the socket buffers
        # hold), and after 0.5 s of that it lets go, long before the answer could be sent.
        wait_until(lambda: viewers() == 0, timeout=30, interval=0.1)
    finally:
        sock.close()
        httpx.post(f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel", timeout=10)
