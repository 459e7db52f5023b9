"""The long poll: ``GET /v1/streams/{id}?format=json&offset=X&wait=S``.

It answers at once when events past X are stored (or the stream is closed), else as soon as the
first new event arrives, else with an empty page (``up_to_date``) once S runs out. A waiting
poll rides its stream's per-process feed, as SSE readers do: many of them cost one live read,
and each its page read before the wait (and after it, when it joined a feed already further
on), never a read per tick.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import pytest

from tests.conftest import BrokerFactory, RunningBroker, command_calls, sync_client
from tests.helpers import start_turn, wait_final, wait_for_deltas, wait_until


def stream_url(broker: RunningBroker, turn: dict[str, Any]) -> str:
    return f"{broker.base_url}/v1/streams/{turn['stream_id']}"


def poll(url: str, offset: str, wait: str | int, timeout: float = 30) -> httpx.Response:
    params = {"format": "json", "offset": offset, "wait": str(wait)}
    return httpx.get(url, params=params, timeout=timeout)


def tail_of(url: str) -> str:
    """The offset of the newest stored event."""
    page = httpx.get(url, params={"format": "json", "offset": "-1"}, timeout=10).json()
    assert page["events"], page
    return str(page["events"][-1]["id"])


def test_stored_events_are_answered_at_once(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, "lp-stored", tokens=5, tokens_per_s=0)
    wait_final(broker.base_url, turn["turn_id"])
    started = time.monotonic()
    page = poll(stream_url(broker, turn), "-1", 20).json()
    assert time.monotonic() - started < 10  # far below the 20 s it may wait
    assert [e["event"] for e in page["events"]][-1] == "end"
    assert page["closed"] is True
    assert page["up_to_date"] is True


def test_a_closed_stream_past_its_end_is_answered_at_once_and_closed(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, "lp-closed", tokens=3, tokens_per_s=0)
    wait_final(broker.base_url, turn["turn_id"])
    url = stream_url(broker, turn)
    started = time.monotonic()
    page = poll(url, tail_of(url), 20).json()
    assert time.monotonic() - started < 10
    assert page["events"] == []
    assert page["closed"] is True


def test_a_waiting_poll_answers_with_the_first_new_event(broker: RunningBroker) -> None:
    # One delta, then the next only after 1.5 s: the poll at the tail waits for it.
    turn = start_turn(broker.base_url, "lp-new", tokens=3, tokens_per_s=0.7)
    url = stream_url(broker, turn)
    wait_until(lambda: httpx.get(url, params={"format": "json"}, timeout=5).json()["events"])
    offset = tail_of(url)
    page = poll(url, offset, 20).json()
    assert page["events"], page
    assert all(e["id"] > offset for e in page["events"])
    assert page["next_offset"] == page["events"][-1]["id"]
    # The cursor resumes: what follows it is all that is left, each event once.
    wait_final(broker.base_url, turn["turn_id"])
    rest = poll(url, page["next_offset"], 0).json()
    everything = httpx.get(url, params={"format": "json", "offset": "-1"}, timeout=10).json()
    after = [e for e in everything["events"] if e["id"] > offset]
    assert page["events"] + rest["events"] == after


def test_a_poll_that_hears_nothing_answers_an_empty_up_to_date_page(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, "lp-quiet", tokens=10, tokens_per_s=0, stall_after_deltas=2)
    url = stream_url(broker, turn)
    wait_for_deltas(url, 2)
    offset = tail_of(url)
    started = time.monotonic()
    response = poll(url, offset, 1)
    waited = time.monotonic() - started
    page = response.json()
    assert response.status_code == 200
    assert page["events"] == []
    assert page["up_to_date"] is True
    assert page["closed"] is False
    assert page["next_offset"] == offset
    assert waited >= 0.9, f"answered after {waited:.2f} s, before its wait ran out"


def test_many_waiting_polls_share_one_live_read(broker: RunningBroker, redis_url: str) -> None:
    pollers = 40
    turn = start_turn(broker.base_url, "lp-many", tokens=3, tokens_per_s=0.5)
    url = stream_url(broker, turn)
    wait_until(lambda: httpx.get(url, params={"format": "json"}, timeout=5).json()["events"])
    offset = tail_of(url)
    client = sync_client(redis_url)
    try:
        xreads, xranges = command_calls(client, "xread"), command_calls(client, "xrange")
        with concurrent.futures.ThreadPoolExecutor(pollers) as pool:
            pages = list(pool.map(lambda _: poll(url, offset, 20).json(), range(pollers)))
        xreads = command_calls(client, "xread") - xreads
        xranges = command_calls(client, "xrange") - xranges
    finally:
        client.close()
    assert all(page["events"] for page in pages), "a poll answered without the new event"
    # Each poll reads its page before it joins the feed, and once more as it joins one that
    # has read further than its start; while they wait, only the feed reads (a blocking read
    # per batch, whatever their number), and the batch that wakes them is their answer.
    assert xranges <= 2 * pollers, xranges
    assert xreads < pollers, xreads


def test_a_poll_whose_client_hangs_up_gives_its_place_back(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, "lp-gone", tokens=10, tokens_per_s=0, stall_after_deltas=2)
    url = stream_url(broker, turn)
    wait_until(
        lambda: len(httpx.get(url, params={"format": "json"}, timeout=5).json()["events"]) > 2
    )
    offset = tail_of(url)
    with pytest.raises(httpx.ReadTimeout):
        poll(url, offset, 25, timeout=0.5)
    # The feed the poll joined ends with its last reader: long before the 25 s wait.
    metrics = f"{broker.base_url}/metrics"
    wait_until(lambda: "broker_live_streams 0.0" in httpx.get(metrics, timeout=5).text, timeout=5)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"format": "json", "wait": "-1"}, "wait must be a whole number of seconds from 0 to 25"),
        ({"format": "json", "wait": "2.5"}, "wait must be a whole number"),
        ({"format": "json", "wait": "26"}, "from 0 to 25"),
        ({"format": "json", "wait": "soon"}, "wait must be a whole number"),
        ({"wait": "5"}, "wait applies to format=json only"),
    ],
)
def test_a_bad_wait_is_a_400(broker: RunningBroker, params: dict[str, str], message: str) -> None:
    turn = start_turn(broker.base_url, "lp-bad", tokens=2, tokens_per_s=0)
    response = httpx.get(stream_url(broker, turn), params=params, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "bad_wait"
    assert message in error["message"]


def test_the_longest_wait_is_a_setting(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(long_poll_max_s=3)
    turn = start_turn(broker.base_url, "lp-short", tokens=2, tokens_per_s=0)
    response = httpx.get(stream_url(broker, turn), params={"format": "json", "wait": "4"})
    assert response.status_code == 400
    assert "from 0 to 3" in response.json()["error"]["message"]


def test_a_chain_of_polls_costs_a_few_reads_per_page(broker: RunningBroker, redis_url: str) -> None:
    # A client that polls again as soon as it has its page, at the pace of a slow live answer
    # (a busy machine's poll round trip stays well inside the 250 ms between deltas): most
    # polls wait at the tail for the next delta.
    turn = start_turn(broker.base_url, "lp-chain", tokens=12, tokens_per_s=4)
    url = stream_url(broker, turn)
    wait_until(lambda: httpx.get(url, params={"format": "json"}, timeout=5).json()["events"])
    # (Not HGET: the worker's scripts read the turn with it. Its append script reads its lease
    # with one HMGET per append: those are taken off, counted by the broker's metric.)
    names = ("get", "exists", "hmget", "xrange", "xrevrange")
    client = sync_client(redis_url)
    try:
        appends = broker.metric("broker_append_seconds_count")
        before = {name: command_calls(client, name) for name in names}
        offset, pages, seen = "-1", 0, []
        while True:
            page = poll(url, offset, 10).json()
            pages += 1
            seen += page["events"]
            offset = page["next_offset"]
            if page["closed"]:
                break
        spent = {name: command_calls(client, name) - before[name] for name in names}
        spent["hmget"] -= int(broker.metric("broker_append_seconds_count") - appends)
    finally:
        client.close()
    everything = httpx.get(url, params={"format": "json", "offset": "-1"}, timeout=10).json()
    assert seen == everything["events"]  # no gap, no duplicate
    assert pages >= 8, pages  # the polls did wait for the deltas one by one
    # Per page: the stream's existence, the turn's state and the page; the stream's index is
    # remembered, and a poll that joins a feed with nothing read past its start reads no more.
    # (The worker's own reads of the turn are in the count too: a few per attempt.)
    assert sum(spent.values()) <= 3 * pages + 4, (spent, pages)
