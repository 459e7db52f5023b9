"""Reading streams: reattach without gap or duplicate, fan-out, ends, pages, headers, retention."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from typing import Any

import httpx
import pytest
import redis as redis_lib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.frames import Entry
from broker.pages import PAGE_CACHE_EVENTS, PageCache
from tests.conftest import BrokerFactory, RunningBroker, command_calls
from tests.helpers import (
    SSEEvent,
    get_turn,
    read_sse,
    start_turn,
    text_of,
    wait_final,
    wait_until,
)

_turns = itertools.count()


def assert_well_ordered(events: list[SSEEvent]) -> None:
    ids = [e.id for e in events]
    assert ids == sorted(ids), "offsets must sort as strings in delivery order"
    assert len(ids) == len(set(ids)), "no event may be delivered twice"


def reference(broker: RunningBroker, stream_id: str) -> list[SSEEvent]:
    """An uninterrupted read of the whole stream."""
    full = read_sse(broker.base_url, stream_id)
    assert full.ended_by_server
    assert full.events[-1].event == "end"
    return full.events


def read_with_cuts(
    broker: RunningBroker, stream_id: str, cuts: list[int], by: str
) -> list[SSEEvent]:
    """Read, hanging up after each number of events in ``cuts``, resuming by header or query."""
    seen: list[SSEEvent] = []
    last: str | None = None
    for cut in [*cuts, None]:
        if by == "header":
            read = read_sse(broker.base_url, stream_id, last_event_id=last, stop_after=cut)
        else:
            read = read_sse(broker.base_url, stream_id, offset=last, stop_after=cut)
        seen += read.events
        if read.events:
            last = read.events[-1].id
        if read.ended_by_server:
            break
    return seen


@pytest.fixture(scope="module")
def shared_broker(redis_url: str) -> object:
    from tests.conftest import start_broker

    broker = start_broker(redis_url)
    yield broker
    broker.stop()


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    cuts=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=6),
    by=st.sampled_from(["header", "query"]),
    live=st.booleans(),
)
def test_reattach_at_any_cut_point_gives_the_same_bytes(
    shared_broker: RunningBroker, cuts: list[int], by: str, live: bool
) -> None:
    broker = shared_broker
    turn = start_turn(
        broker.base_url,
        turn_id=f"cut-{next(_turns)}",
        seed=next(_turns),
        tokens=30,
        tokens_per_s=300 if live else 0,
    )
    stream_id = turn["stream_id"]
    seen = read_with_cuts(broker, stream_id, cuts, by)
    whole = reference(broker, stream_id)
    assert_well_ordered(seen)
    assert text_of(seen).encode() == text_of(whole).encode()
    assert [(e.id, e.event, e.data) for e in seen] == [(e.id, e.event, e.data) for e in whole]


def test_late_reader_of_a_finished_turn_gets_everything_and_ends(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, turn_id="late", tokens=15, tokens_per_s=0)
    wait_final(broker.base_url, "late")
    read = read_sse(broker.base_url, turn["stream_id"], timeout=5)
    assert read.ended_by_server
    assert next(e.event for e in read.events) == "attempt"
    assert read.events[-1].event == "end"
    assert read.events[-1].data["status"] == "complete"
    assert text_of(read.events) == get_turn(broker.base_url, "late")["canonical"]["text"]


def test_resuming_at_the_last_offset_of_a_finished_turn_ends_at_once(
    broker: RunningBroker,
) -> None:
    turn = start_turn(broker.base_url, turn_id="tail", tokens=5, tokens_per_s=0)
    events = reference(broker, turn["stream_id"])
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    for params, headers in (
        ({}, {"Last-Event-ID": events[-1].id}),
        ({"offset": events[-1].id}, {}),
        ({"offset": "now"}, {}),
    ):
        # 204, not an empty 200: EventSource stops on 204 instead of reconnecting for ever.
        response = httpx.get(url, params=params, headers=headers, timeout=5)
        assert response.status_code == 204
        assert response.content == b""
    # One event before the end still gets that event, then the end of the response.
    read = read_sse(broker.base_url, turn["stream_id"], last_event_id=events[-2].id, timeout=5)
    assert read.events == events[-1:]
    assert read.ended_by_server


def test_replay_is_exclusive_of_the_given_offset(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, turn_id="excl", tokens=8, tokens_per_s=0)
    events = reference(broker, turn["stream_id"])
    read = read_sse(broker.base_url, turn["stream_id"], offset=events[3].id)
    assert read.events == events[4:]


def test_last_event_id_wins_over_the_offset_query(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, turn_id="prec", tokens=8, tokens_per_s=0)
    events = reference(broker, turn["stream_id"])
    read = read_sse(
        broker.base_url, turn["stream_id"], offset=events[1].id, last_event_id=events[5].id
    )
    assert read.events == events[6:]


def test_two_concurrent_viewers_see_identical_sequences(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, turn_id="two", tokens=40, tokens_per_s=200)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reads = list(pool.map(lambda _: read_sse(broker.base_url, turn["stream_id"]), range(2)))
    assert reads[0].events == reads[1].events
    assert reads[0].events[-1].event == "end"
    assert_well_ordered(reads[0].events)


def test_offset_now_delivers_only_new_events(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, turn_id="now", tokens=40, tokens_per_s=100)
    first = read_sse(broker.base_url, turn["stream_id"], stop_after=3)
    later = read_sse(broker.base_url, turn["stream_id"], offset="now")
    whole = reference(broker, turn["stream_id"])
    assert later.events, "a live turn has new events"
    assert later.events[0].id > first.events[-1].id
    assert later.events == whole[len(whole) - len(later.events) :]


def test_a_read_from_now_announces_its_resume_point(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, turn_id="now-id", tokens=30, tokens_per_s=40)
    first = read_sse(broker.base_url, turn["stream_id"], stop_after=2)
    # Hang up before any new event: the opening frame's id is the point to resume from.
    quick = read_sse(broker.base_url, turn["stream_id"], offset="now", stop_after=0)
    assert quick.last_id is not None
    assert quick.last_id >= first.events[-1].id
    rest = read_sse(broker.base_url, turn["stream_id"], last_event_id=quick.last_id)
    whole = reference(broker, turn["stream_id"])
    assert rest.events == [e for e in whole if e.id > quick.last_id]
    assert read_sse(broker.base_url, turn["stream_id"], offset="-1").events == whole


def test_sse_headers_retry_and_heartbeat(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(sse_heartbeat_s=0.1, sse_retry_ms=1234)
    turn = start_turn(broker.base_url, turn_id="hb", tokens=3, tokens_per_s=2)
    read = read_sse(broker.base_url, turn["stream_id"])
    assert read.headers["content-type"].startswith("text/event-stream")
    assert read.headers["cache-control"] == "no-store"
    assert read.headers["x-accel-buffering"] == "no"
    assert read.retry == 1234
    assert read.comments >= 2, "a quiet stream gets heartbeat comments"
    assert read.events[-1].event == "end"


def test_many_viewers_in_one_process_share_one_redis_read(
    broker: RunningBroker, raw_redis: redis_lib.Redis
) -> None:
    turn = start_turn(broker.base_url, turn_id="fan", tokens=30, tokens_per_s=60)
    viewers = 20

    def xread_calls() -> int:
        return command_calls(raw_redis, "xread")  # on a cluster, summed over the primaries

    before = xread_calls()
    with concurrent.futures.ThreadPoolExecutor(viewers) as pool:
        reads = list(
            pool.map(lambda _: read_sse(broker.base_url, turn["stream_id"]), range(viewers))
        )
    calls = xread_calls() - before
    assert all(r.events == reads[0].events for r in reads)
    deltas = sum(1 for e in reads[0].events if e.event == "delta")
    assert deltas == 30
    # One shared feed reads each event once; per-viewer reads would need ~viewers x events.
    assert calls < 2 * (deltas + 5), f"{calls} XREADs for {viewers} viewers of {deltas} deltas"


def test_readers_of_one_answer_read_each_full_page_from_redis_once(
    broker_factory: BrokerFactory, raw_redis: redis_lib.Redis
) -> None:
    # Pages kept 30 s: what is counted does not depend on how soon the readers come.
    broker = broker_factory(sse_page_cache_s=30)
    turn = start_turn(broker.base_url, turn_id="crowd-pages", tokens=300, tokens_per_s=0, seed=4)
    assert wait_final(broker.base_url, turn["turn_id"])["status"] == "complete"
    whole = reference(broker, turn["stream_id"])  # the first reader reads every page
    assert len(whole) > 64 + 128  # pages of 64 and 128, full, and a short last one
    readers = 10

    def xrange_calls() -> int:
        return command_calls(raw_redis, "xrange")

    before = xrange_calls()
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        reads = list(pool.map(lambda _: read_sse(broker.base_url, turn["stream_id"]), range(10)))
    calls = xrange_calls() - before
    assert all(r.events == whole for r in reads)
    # Each reads the short last page only (it might have grown); each would read four without.
    assert calls <= readers + 2, f"{calls} XRANGEs for {readers} readers"


def test_readers_joining_a_live_answer_share_its_pages_up_to_what_the_feed_read(
    broker_factory: BrokerFactory, raw_redis: redis_lib.Redis
) -> None:
    # A live turn gone quiet after 250 deltas: one reader follows it (its feed starts on the
    # last entry that reader read), then a crowd joins from the start.
    broker = broker_factory(sse_page_cache_s=30)
    turn = start_turn(
        broker.base_url,
        turn_id="join-pages",
        tokens=400,
        tokens_per_s=0,
        stall_after_deltas=250,
        seed=5,
    )
    stream_id = turn["stream_id"]
    prefix = read_sse(broker.base_url, stream_id, stop_after=240).events  # stored by now
    assert len(prefix) == 240
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        follower = pool.submit(read_sse, broker.base_url, stream_id, timeout=30)
        wait_until(lambda: broker.metric("broker_live_streams") >= 1, timeout=10)
        before = command_calls(raw_redis, "xrange")
        joiners = list(
            pool.map(
                lambda _: read_sse(broker.base_url, stream_id, stop_after=240).events, range(10)
            )
        )
        calls = command_calls(raw_redis, "xrange") - before
        assert all(events == prefix for events in joiners)
        # Pages of 64 and 128 are full, and shared; the short last one, read up to the entry
        # the feed stands on, is the same for every joiner too: one read in all, where each
        # joiner read it for itself before (ten).
        assert calls <= 3, f"{calls} XRANGEs for 10 joiners"
        httpx.post(f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel", timeout=10)
        followed = follower.result(timeout=30)
    assert followed.ended_by_server
    assert followed.events[:240] == prefix
    assert_well_ordered(followed.events)
    assert followed.events[-1].event == "end"


def test_a_resume_point_past_the_stream_never_bounds_the_shared_pages(
    broker_factory: BrokerFactory,
) -> None:
    # A client may name an id the stream has not reached: a feed started there has seen
    # nothing, and pages bounded by that id would miss what is appended before it.
    broker = broker_factory(sse_page_cache_s=30, sse_heartbeat_s=1)
    turn = start_turn(
        broker.base_url, turn_id="far-resume", tokens=50, tokens_per_s=0, stall_after_deltas=20
    )
    stream_id = turn["stream_id"]
    prefix = read_sse(broker.base_url, stream_id, stop_after=20).events
    key = broker.runtime.keys.events("conv-1", "far-resume")
    far = "9999999999999999-0000000000"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(read_sse, broker.base_url, stream_id, last_event_id=far, timeout=30)
        wait_until(lambda: broker.metric("broker_live_streams") >= 1, timeout=10)
        assert broker.runtime.hub.seen(key) is None
        assert read_sse(broker.base_url, stream_id, stop_after=20).events == prefix
        httpx.post(f"{broker.base_url}/v1/turns/far-resume/cancel", timeout=10)
        assert waiting.result(timeout=30).events == []  # nothing lies past its resume point
    whole = reference(broker, stream_id)
    assert whole[:20] == prefix
    assert whole[-1].event == "end"


def test_kept_pages_expire_and_stay_within_their_bound() -> None:
    entry = Entry.from_redis("1-0", ["e", "delta", "d", "{}"])
    pages = PageCache(ttl_s=1.0)
    pages.put(("k", "0-0", "+", 2), [entry, entry], 0.0)
    assert pages.get(("k", "0-0", "+", 2), 0.5) == [entry, entry]
    assert pages.get(("k", "0-0", "+", 3), 0.5) is None  # another page
    assert pages.get(("k", "0-0", "+", 2), 1.0) is None  # its time ran out
    half = [entry] * (PAGE_CACHE_EVENTS // 2)
    for n in range(3):
        pages.put(("k", str(n), "+", len(half)), half, 2.0)
    # The first two fill the room and stay their time: the third is not kept (a reader going
    # through a stream longer than the bound leaves its first pages to the next readers).
    assert pages.get(("k", "0", "+", len(half)), 2.1) == half
    assert pages.get(("k", "1", "+", len(half)), 2.1) == half
    assert pages.get(("k", "2", "+", len(half)), 2.1) is None
    pages.put(("k", "big", "+", PAGE_CACHE_EVENTS + 1), [entry] * (PAGE_CACHE_EVENTS + 1), 3.5)
    assert pages.get(("k", "big", "+", PAGE_CACHE_EVENTS + 1), 3.6) is None  # never kept
    # Once their time ran out, a page finds room (they are gone, found or not).
    pages.put(("k", "3", "+", len(half)), half, 3.5)
    assert pages.get(("k", "3", "+", len(half)), 3.6) == half
    assert pages.get(("k", "0", "+", len(half)), 3.6) is None
    for n in range(4, 6):
        pages.put(("k", str(n), "+", len(half)), half, 3.6)
    assert pages.get(("k", "4", "+", len(half)), 3.7) == half
    assert pages.get(("k", "5", "+", len(half)), 3.7) is None  # full again
    # Another stream's page pushes out the oldest pages of others.
    pages.put(("other", "0", "+", len(half)), half, 3.8)
    assert pages.get(("other", "0", "+", len(half)), 3.9) == half
    assert pages.get(("k", "3", "+", len(half)), 3.9) is None
    assert pages.get(("k", "4", "+", len(half)), 3.9) == half


def test_json_catch_up_pages(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(json_page_size=4)
    turn = start_turn(broker.base_url, turn_id="poll", tokens=9, tokens_per_s=0)
    whole = reference(broker, turn["stream_id"])
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    offset, collected, pages = "-1", [], 0
    while True:
        page = httpx.get(url, params={"format": "json", "offset": offset}, timeout=5).json()
        pages += 1
        collected += page["events"]
        offset = page["next_offset"]
        if page["closed"]:
            assert page["up_to_date"]
            break
        assert pages < 20
    assert [(e["id"], e["event"], e["data"]) for e in collected] == [
        (e.id, e.event, e.data) for e in whole
    ]
    assert offset == whole[-1].id
    again = httpx.get(url, params={"format": "json", "offset": offset}, timeout=5).json()
    assert again == {"events": [], "next_offset": offset, "up_to_date": True, "closed": True}


def test_json_page_of_a_live_turn_is_not_closed(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, turn_id="poll-live", tokens=50, tokens_per_s=20)
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    wait_until(lambda: httpx.get(url, params={"format": "json"}, timeout=5).json()["events"])
    page = httpx.get(url, params={"format": "json", "offset": "-1"}, timeout=5).json()
    assert page["closed"] is False
    assert page["up_to_date"] is True


def test_stream_over_its_event_limit_fails_cleanly(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(max_stream_events=10)
    turn = start_turn(broker.base_url, turn_id="big", tokens=50, tokens_per_s=0)
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert len(events) <= 12
    assert events[-2].event == "error"
    assert events[-2].data["code"] == "stream_limit"
    assert events[-1].data == {"attempt": 1, "status": "failed", "reason": "stream_limit"}
    assert get_turn(broker.base_url, "big")["status"] == "failed"


def test_finished_turns_expire_and_then_answer_410(
    broker_factory: BrokerFactory, raw_redis: redis_lib.Redis
) -> None:
    # 2 s: long enough that a loaded machine still sees the keys between the turn's end and
    # the pttl below (at 0.5 s they could be gone already).
    broker = broker_factory(stream_ttl=2)
    turn = start_turn(broker.base_url, turn_id="old", tokens=3, tokens_per_s=0)
    wait_final(broker.base_url, "old")
    keys = broker.runtime.keys
    ttl = raw_redis.pttl(keys.events("conv-1", "old"))
    assert 0 < ttl <= 2000
    assert raw_redis.pttl(keys.turn_index("old")) > 2000  # the tombstone outlives the data
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    gone = wait_until(lambda: (r := httpx.get(url, timeout=5)).status_code == 410 and r, 10)
    assert gone.json()["error"]["code"] == "expired"
    assert httpx.get(f"{broker.base_url}/v1/turns/old", timeout=5).status_code == 410
    # The id stays taken: repeating the POST must not pay for a second generation.
    again = start_turn(broker.base_url, turn_id="old", tokens=3, tokens_per_s=0, expect=410)
    assert again["error"]["code"] == "expired"
    assert broker.metric("broker_turns_started_total") == 1


@pytest.mark.parametrize(
    ("params", "headers", "status", "code"),
    [
        ({"offset": "12"}, {}, 400, "bad_offset"),
        ({"offset": "0-0"}, {}, 400, "bad_offset"),
        ({"offset": "abc"}, {}, 400, "bad_offset"),
        ({}, {"Last-Event-ID": "garbage"}, 400, "bad_offset"),
        ({"offset": "0000000000000001-00000000001"}, {}, 400, "bad_offset"),
        ({"format": "xml"}, {}, 400, "bad_format"),
    ],
)
def test_malformed_reads_are_400(
    broker: RunningBroker, params: dict[str, str], headers: dict[str, str], status: int, code: str
) -> None:
    turn = start_turn(broker.base_url, tokens=2, tokens_per_s=0)
    response = httpx.get(
        f"{broker.base_url}/v1/streams/{turn['stream_id']}",
        params=params,
        headers=headers,
        timeout=5,
    )
    assert response.status_code == status
    assert response.json()["error"]["code"] == code


@pytest.mark.parametrize("stream_id", ["st_" + "0" * 32, "nope", "st_xyz", "x" * 300])
def test_unknown_streams_are_404(broker: RunningBroker, stream_id: str) -> None:
    for fmt in ("sse", "json"):
        response = httpx.get(
            f"{broker.base_url}/v1/streams/{stream_id}", params={"format": fmt}, timeout=5
        )
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


def test_a_read_from_now_on_an_empty_stream_resumes_from_the_start(
    broker_factory: BrokerFactory,
) -> None:
    api = broker_factory(role="api")
    turn = start_turn(api.base_url, turn_id="empty-now", tokens=5, tokens_per_s=0)
    quick = read_sse(api.base_url, turn["stream_id"], offset="now", stop_after=0)
    assert quick.last_id == "0000000000000000-0000000000"
    broker_factory(role="worker", key_prefix=api.settings.key_prefix)
    rest = read_sse(api.base_url, turn["stream_id"], last_event_id=quick.last_id)
    assert next(e.event for e in rest.events) == "attempt"
    assert rest.events == read_sse(api.base_url, turn["stream_id"]).events


def test_sse_resumes_are_counted_and_an_expired_stream_is_410(
    broker_factory: BrokerFactory,
) -> None:
    """An SSE read learns that its data expired from its opening round trip: 410 all the same,
    and each resume's outcome is counted once."""
    broker = broker_factory(stream_ttl=0.5)
    # The resume comes while the turn runs (its keys expire only once it ends), so it never
    # races the 0.5 s expiry on a loaded machine; then the turn is ended.
    turn = start_turn(broker.base_url, turn_id="counted", tokens=1000, tokens_per_s=10)
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    events = read_sse(broker.base_url, turn["stream_id"], stop_after=2).events
    resumed = read_sse(broker.base_url, turn["stream_id"], last_event_id=events[0].id, stop_after=1)
    assert resumed.events == events[1:2]
    assert broker.metric("broker_resumes_total", '{result="ok"}') == 1
    httpx.post(f"{broker.base_url}/v1/turns/counted/cancel", timeout=5).raise_for_status()
    wait_final(broker.base_url, "counted")
    gone = wait_until(lambda: (r := httpx.get(url, timeout=5)).status_code == 410 and r, 5)
    assert gone.json()["error"]["code"] == "expired"
    again = httpx.get(url, headers={"Last-Event-ID": events[0].id}, timeout=5)
    assert again.status_code == 410
    assert broker.metric("broker_resumes_total", '{result="expired"}') == 1
    assert broker.metric("broker_resumes_total", '{result="ok"}') == 1
    unknown = httpx.get(f"{broker.base_url}/v1/streams/st_{'0' * 32}", timeout=5)
    assert unknown.status_code == 404


def _awaiting(broker: RunningBroker) -> list[list[str]]:
    """For each request task of the broker's loop, the qualified names of the coroutines it
    is suspended in, outermost first (what each layer keeps alive while a response lasts)."""

    async def chains() -> list[list[str]]:
        found = []
        for task in asyncio.all_tasks():
            coro: Any = task.get_coro()
            if getattr(coro, "__qualname__", "") != "RequestResponseCycle.run_asgi":
                continue
            names = []
            while coro is not None and hasattr(coro, "cr_await"):
                names.append(coro.__qualname__)
                coro = coro.cr_await
            found.append(names)
        return found

    result: list[list[str]] = broker.call(chains())
    return result


LAYERS = {"SecurityHeaders.__call__", "Compression.__call__"}
STOCK_PROTOCOL = {"_through_connection", "StockHttpProtocol.serve"}


def test_a_plain_sse_read_is_answered_ahead_of_every_layer_and_a_cors_one_through_them(
    broker_factory: BrokerFactory,
) -> None:
    origin = "https://app.example"
    broker = broker_factory(cors_origins=origin)
    turn = start_turn(broker.base_url, turn_id=f"front-{next(_turns)}", tokens=400, tokens_per_s=20)
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"
    headers_seen = {}
    for label, extra in (("plain", {}), ("cors", {"Origin": origin})):
        with httpx.stream("GET", url, headers=extra, timeout=10) as response:
            assert response.status_code == 200
            body = response.iter_bytes()  # (kept: an iterator dropped closes the response)
            assert next(body)
            chains = _awaiting(broker)
            reading = [c for c in chains if "EventStreamResponse.__call__" in c]
            assert len(reading) == 1, chains
            if label == "plain":  # the app runs the response itself, under no other layer
                # (the stock protocol's own ASGI layer aside: BROKER_FAST_PATH=off)
                chain = [name for name in reading[0] if name not in STOCK_PROTOCOL]
                assert chain[:5] == [
                    "RequestResponseCycle.run_asgi",
                    "ProxyHeadersMiddleware.__call__",
                    "FrontDoor.__call__",
                    "StreamReads.__call__",
                    "EventStreamResponse.__call__",
                ]
                assert not LAYERS & set(reading[0])
            else:
                assert set(reading[0]) >= LAYERS
                assert response.headers["access-control-allow-origin"] == origin
            headers_seen[label] = response.headers
    for headers in headers_seen.values():  # the same headers either way, the security ones too
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["referrer-policy"] == "no-referrer"
        assert headers["content-type"] == "text/event-stream"
        assert headers["vary"].startswith("Accept-Encoding")
    # Errors answered at the front carry them as well.
    bad = httpx.get(f"{url}?offset=nope", timeout=5)
    assert bad.status_code == 400
    assert bad.headers["x-content-type-options"] == "nosniff"
    httpx.post(f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel", timeout=10)


def test_sse_reads_are_served_below_the_framework_and_json_pages_through_it(
    broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from broker.api import routes, stream_reads

    seen: dict[str, list[str]] = {"fast": [], "routed": []}

    def counting(where: str, real: Any) -> Any:
        def checked(rt: Any, stream_id: str, *args: Any, **kwargs: Any) -> Any:
            seen[where].append(stream_id)
            return real(rt, stream_id, *args, **kwargs)

        return checked

    monkeypatch.setattr(stream_reads, "checked_read", counting("fast", routes.checked_read))
    monkeypatch.setattr(routes, "checked_read", counting("routed", routes.checked_read))
    broker = broker_factory()
    turn = start_turn(broker.base_url, turn_id=f"fast-{next(_turns)}", tokens=4)
    events = reference(broker, turn["stream_id"])
    assert seen == {"fast": [turn["stream_id"]], "routed": []}
    page = httpx.get(f"{broker.base_url}/v1/streams/{turn['stream_id']}?format=json")
    assert page.status_code == 200
    assert [e["id"] for e in page.json()["events"]] == [e.id for e in events]
    assert seen == {"fast": [turn["stream_id"]], "routed": [turn["stream_id"]]}
    # The fast path answers errors as the app does: the same shape, status and code.
    bad = httpx.get(f"{broker.base_url}/v1/streams/{turn['stream_id']}?offset=nope")
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "bad_offset"
    assert len(seen["fast"]) == 2
    assert len(seen["routed"]) == 1
    # Not a stream read: a trailing slash or a deeper path is the framework's (its 404/307).
    deeper = httpx.get(f"{broker.base_url}/v1/streams/{turn['stream_id']}/x")
    assert deeper.status_code == 404
    assert deeper.json()["error"]["code"] == "not_found"
    assert len(seen["fast"]) == 2
