"""Deltas that arrive while an append is in flight, or in a burst within the linger, share the
next append; nothing else changes. (The rule itself, on a clock the tests move: test_linger.py.)"""

from __future__ import annotations

import time

import httpx

from broker.embedded_redis import EmbeddedRedis
from broker.offsets import to_entry_id
from tests.conftest import BrokerFactory, RunningBroker, start_broker
from tests.helpers import get_turn, read_sse, start_turn, text_of, wait_final, wait_until
from tests.tcp_proxy import CutProxy


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


def test_a_burst_shares_appends_within_the_linger(broker_factory: BrokerFactory) -> None:
    # 50 deltas/s, one every 20 ms: each append comes back long before the next delta, so
    # without a linger every delta would be an append of its own. With a linger of 200 ms
    # they are a burst (8 of them come within it), once 8 have come.
    lingering = broker_factory(append_linger_ms=200)
    before = appends(lingering)
    turn = start_turn(lingering.base_url, "c", tokens=40, tokens_per_s=50, seed=3)
    assert wait_final(lingering.base_url, turn["turn_id"])["status"] == "complete"
    used = appends(lingering) - before
    events = read_sse(lingering.base_url, turn["stream_id"]).events
    assert len([e for e in events if e.event == "delta"]) == 40
    assert events[0].event == "attempt"
    assert events[-1].event == "end"
    ids = [e.id for e in events]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    # The first output alone, 7 deltas alone until the burst is seen, then groups of the
    # deltas of 140 ms (7 gaps): the end and whatever else follows need a few more.
    assert used <= 40 / 2, used
    assert get_turn(lingering.base_url, turn["turn_id"])["canonical"]["text"] == text_of(events)


def test_a_slow_redis_lingers_before_every_append_not_only_the_first(
    redis_server: EmbeddedRedis,
) -> None:
    # Every Redis reply 25 ms late: each append takes longer than the 10 ms between deltas, so
    # a delta is always waiting when an append ends. In a burst (10 ms apart against a linger
    # of 200) they must still go a window apart (7 gaps, from the last append's start), not at
    # once in appends of two or three. (A proxy in front of one server, the session's single
    # one, in the cluster pass too.)
    with CutProxy(redis_server.url, reply_delay_s=0.025) as proxy:
        broker = start_broker(proxy.url.replace("http://", "redis://"), append_linger_ms=200)
        try:
            before = appends(broker)
            turn = start_turn(broker.base_url, "c", tokens=80, tokens_per_s=100, seed=5)
            assert wait_final(broker.base_url, turn["turn_id"], timeout=30)["status"] == "complete"
            used = appends(broker) - before
            events = read_sse(broker.base_url, turn["stream_id"]).events
        finally:
            broker.stop()
    assert [e.event for e in events].count("delta") == 80
    # 0.8 s of deltas: the first output, a few until the burst is seen, appends 70 ms apart,
    # the end. Appends that went as soon as the last one came back would be about 30.
    assert used <= 22, used


def test_a_long_linger_delays_neither_the_first_delta_nor_the_end(
    broker_factory: BrokerFactory,
) -> None:
    # A linger of a second and deltas 50 ms apart: the first delta goes at once, and the end
    # must not wait out a linger either. Times are Redis's own, from the entry ids (the server
    # shares this clock).
    broker = broker_factory(append_linger_ms=1_000)
    posted_ms = time.time() * 1000
    turn = start_turn(broker.base_url, "c", tokens=3, tokens_per_s=20)
    assert wait_final(broker.base_url, turn["turn_id"])["status"] == "complete"
    events = read_sse(broker.base_url, turn["stream_id"], timeout=5).events
    assert [e.event for e in events].count("delta") == 3
    at_ms = {e.event: int(to_entry_id(e.id).split("-")[0]) for e in reversed(events)}
    assert at_ms["delta"] - posted_ms < 700  # the first delta went at once
    assert at_ms["end"] - at_ms["delta"] < 700  # the end did not wait for the linger


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
            return broker.metric("broker_stream_viewers", '{dialect="native",mode="sse"}')

        wait_until(lambda: viewers() == 1, timeout=10)
        # Never read: the broker's writes back up (8 MB is more than the socket buffers
        # hold), and after 0.5 s of that it lets go, long before the answer could be sent.
        wait_until(lambda: viewers() == 0, timeout=30, interval=0.1)
    finally:
        sock.close()
        httpx.post(f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel", timeout=10)
