"""Quiet streams: readers of a stream with nothing to say cost a heartbeat each, and Redis work
per stream, not per reader.

A reader that hears nothing for a heartbeat period sends a heartbeat and looks whether its turn
came to rest (it may have without an event this reader could see). Every reader of a stream in
a process shares that look: one ``HMGET`` per stream and heartbeat period, however many read.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import httpx

from tests.conftest import BrokerFactory, command_calls, sync_client
from tests.helpers import pings_and_gaps, start_turn, wait_for_deltas, wait_until

READERS = 30
HEARTBEAT_S = 0.25


def read_pings(url: str, pings: list[int], index: int, stop: threading.Event) -> None:
    """Count the heartbeats of one SSE read until ``stop``."""
    with httpx.stream("GET", url, timeout=20) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(":"):
                pings[index] += 1
            if stop.is_set():
                return


def test_readers_of_a_quiet_stream_share_one_look_per_heartbeat(
    broker_factory: BrokerFactory, redis_url: str
) -> None:
    broker = broker_factory(sse_heartbeat_s=HEARTBEAT_S)
    turn = start_turn(broker.base_url, "quiet", tokens=10, tokens_per_s=0, stall_after_deltas=2)
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    wait_for_deltas(url, 2)
    pings, stop = [0] * READERS, threading.Event()
    readers = [
        threading.Thread(target=read_pings, args=(url, pings, i, stop), daemon=True)
        for i in range(READERS)
    ]
    for reader in readers:
        reader.start()
    client = sync_client(redis_url)
    try:
        least: Callable[[], int] = lambda: min(pings)  # noqa: E731
        wait_until(lambda: least() >= 1, timeout=20)  # every reader attached and heard one
        before, heard = command_calls(client, "hmget"), least()
        wait_until(lambda: least() >= heard + 8, timeout=30)
        spent, periods = command_calls(client, "hmget") - before, least() - heard
    finally:
        stop.set()
        client.close()
    # One look per stream and period (two, where a tick falls on the edge of one), not one per
    # reader: 30 readers looking for themselves would make 30 per period.
    assert spent <= 2 * periods + 4, (spent, periods)
    httpx.post(f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel", timeout=10)


def test_readers_with_different_heartbeat_periods_each_hear_theirs(
    broker_factory: BrokerFactory,
) -> None:
    # One stream's parked readers mixing two periods: the ticker, which looks at the front of
    # a stream's readers in deadline order only, must still find each one when it is due.
    broker = broker_factory(sse_heartbeat_s=1, sse_heartbeat_max_s=5)
    turn = start_turn(broker.base_url, "mixed", tokens=10, tokens_per_s=0, stall_after_deltas=2)
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    wait_for_deltas(url, 2)
    periods = [1, 2, 1, 2, 2, 1]
    with concurrent.futures.ThreadPoolExecutor(len(periods)) as pool:
        heard = list(
            pool.map(
                lambda p: pings_and_gaps(broker.base_url, turn["stream_id"], {"heartbeat": str(p)}),
                periods,
            )
        )
    slack = 0.25 + 0.2  # the ticker's quarter period at most, and this client's own delays
    for period, gaps in zip(periods, heard, strict=True):
        # Due every period, sent within a quarter of it (at most the ticker's 0.25 s) once due.
        assert max(gaps) <= period + slack, (period, gaps)
        # Not another reader's period (1 s and 2 s stay apart by more than twice the slack). A
        # ping this client took late shortens the gap after it as much as it lengthened the
        # one before (2.24 s then 1.78 s, in CI).
        assert min(gaps) >= period - slack, (period, gaps)
    httpx.post(f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel", timeout=10)
