"""Tests for BrokerClient and the command line against a scripted in-memory broker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from broker_client import (
    AttachPolicy,
    AttachStats,
    BadRequest,
    BrokerClient,
    BrokerConnectionError,
    BrokerHTTPError,
    Conflict,
    Event,
    Forbidden,
    NotFound,
    ProtocolError,
    ReattachExhausted,
    ReconnectInfo,
    ResponseEnded,
    ServerError,
    StreamExpired,
    StreamNotFound,
    TurnNotFound,
    Unauthorized,
    backoff_delay,
)
from broker_client.__main__ import main
from tests.client.scripted import BASE, FAST, Body, Broker, drop, eid, error, frame, sse


@asynccontextmanager
async def connect(broker: Broker, policy: AttachPolicy = FAST) -> AsyncIterator[BrokerClient]:
    async with (
        httpx.AsyncClient(transport=broker.transport()) as http,
        BrokerClient(BASE, http=http, policy=policy) as client,
    ):
        yield client


async def collect(
    broker: Broker,
    stream_id: str = "s1",
    *,
    offset: str = "-1",
    policy: AttachPolicy = FAST,
    stats: AttachStats | None = None,
    on_reconnect: Callable[[ReconnectInfo], None] | None = None,
    stop: asyncio.Event | None = None,
) -> list[Event]:
    async with connect(broker, policy) as client, asyncio.timeout(5):
        return [
            event
            async for event in client.attach(
                stream_id, offset=offset, stats=stats, on_reconnect=on_reconnect, stop=stop
            )
        ]


def ids(events: list[Event]) -> list[str]:
    return [event.id for event in events]


# attach: following a stream


async def test_attach_follows_a_stream_until_end() -> None:
    broker = Broker(
        sse(
            "retry: 1000\n\n",
            frame(1, "attempt", strategy="initial"),
            frame(2, "delta", text="Hello"),
            ": ping\n\n",
            frame(3, "end", status="complete", reason=None),
        )
    )
    stats = AttachStats()
    events = await collect(broker, stats=stats)
    assert [(e.type, e.attempt) for e in events] == [("attempt", 1), ("delta", 1), ("end", 1)]
    assert events[1].data == {"attempt": 1, "text": "Hello"}
    assert ids(events) == [eid(1), eid(2), eid(3)]
    assert len(broker.requests) == 1
    request = broker.requests[0]
    assert request.url.path == "/v1/streams/s1"
    assert request.url.params["offset"] == "-1"
    assert request.headers["accept"] == "text/event-stream"
    assert "last-event-id" not in request.headers
    assert stats.reconnects == 0
    assert stats.heartbeats == 1
    assert stats.last_event_id == eid(3)


async def test_attach_sends_the_given_offset_and_quotes_the_stream_id() -> None:
    broker = Broker(sse(frame(1, "end", status="complete")))
    await collect(broker, "conv/1:turn 2", offset="now")
    assert broker.requests[0].url.params["offset"] == "now"
    assert broker.requests[0].url.raw_path.startswith(b"/v1/streams/conv%2F1%3Aturn%202?")


async def test_attach_uses_the_policy_read_timeout() -> None:
    broker = Broker(sse(frame(1, "end", status="complete")))
    policy = AttachPolicy(read_timeout=12.5, connect_timeout=3.0)
    await collect(broker, policy=policy)
    timeout = broker.requests[0].extensions["timeout"]
    assert timeout["read"] == 12.5
    assert timeout["connect"] == 3.0


async def test_end_that_is_not_last_does_not_stop_the_stream() -> None:
    # An interrupted attempt ends, and the broker keeps the response open for the retry.
    broker = Broker(
        sse(
            frame(1, "delta", text="a"),
            frame(2, "end", status="interrupted"),
            frame(3, "attempt", 2, strategy="continue"),
            frame(4, "delta", 2, text="b"),
            frame(5, "end", 2, status="complete"),
        )
    )
    events = await collect(broker)
    assert ids(events) == [eid(n) for n in range(1, 6)]
    assert len(broker.requests) == 1


# attach: reconnecting


async def test_reattaches_after_a_drop_with_last_event_id() -> None:
    broker = Broker(
        sse(frame(1, "attempt", strategy="initial"), frame(2, "delta", text="a"), fail=drop()),
        # The server replays event 2 as well; the client must not yield it twice.
        sse(frame(2, "delta", text="a"), frame(3, "delta", text="b"), frame(4, "end")),
    )
    stats = AttachStats()
    reconnects: list[ReconnectInfo] = []
    events = await collect(broker, stats=stats, on_reconnect=reconnects.append)
    assert ids(events) == [eid(1), eid(2), eid(3), eid(4)]
    assert len(broker.requests) == 2
    retry = broker.requests[1]
    assert retry.headers["last-event-id"] == eid(2)
    assert retry.url.params["offset"] == eid(2)
    assert stats.reconnects == 1
    assert stats.duplicates == 1
    assert len(reconnects) == 1
    assert isinstance(reconnects[0].error, httpx.ReadError)
    assert reconnects[0].last_event_id == eid(2)


async def test_reattaches_when_the_response_ends_without_end_event() -> None:
    broker = Broker(sse(frame(1, "delta", text="a")), sse(frame(2, "end", status="complete")))
    reconnects: list[ReconnectInfo] = []
    events = await collect(broker, on_reconnect=reconnects.append)
    assert ids(events) == [eid(1), eid(2)]
    assert broker.requests[1].headers["last-event-id"] == eid(1)
    assert isinstance(reconnects[0].error, ResponseEnded)


async def test_drop_right_after_end_reattaches_then_returns_on_clean_close() -> None:
    broker = Broker(
        sse(frame(1, "delta", text="a"), frame(2, "end", status="complete"), fail=drop()),
        sse(),
    )
    events = await collect(broker)
    assert ids(events) == [eid(1), eid(2)]
    assert len(broker.requests) == 2
    assert broker.requests[1].headers["last-event-id"] == eid(2)


async def test_204_after_a_drop_means_nothing_more_will_come() -> None:
    broker = Broker(
        sse(frame(1, "delta", text="a"), frame(2, "end", status="complete"), fail=drop()),
        httpx.Response(204),
    )
    async with connect(broker) as client:
        events = [e async for e in client.attach("s1")]
    assert [e.type for e in events] == ["delta", "end"]
    assert broker.requests[1].headers["last-event-id"] == eid(2)


async def test_read_timeout_counts_as_a_dead_connection() -> None:
    broker = Broker(
        sse(frame(1, "delta", text="a"), fail=httpx.ReadTimeout("no heartbeat")),
        sse(frame(2, "end")),
    )
    events = await collect(broker)
    assert ids(events) == [eid(1), eid(2)]
    assert broker.requests[1].headers["last-event-id"] == eid(1)


async def test_503_then_success() -> None:
    broker = Broker(error(503, "redis_unavailable"), sse(frame(1, "end", status="complete")))
    reconnects: list[ReconnectInfo] = []
    events = await collect(broker, on_reconnect=reconnects.append)
    assert ids(events) == [eid(1)]
    failure = reconnects[0].error
    assert isinstance(failure, ServerError)
    assert (failure.status, failure.code) == (503, "redis_unavailable")
    # Nothing was received before the retry, so it starts from the original offset again.
    assert broker.requests[1].url.params["offset"] == "-1"
    assert "last-event-id" not in broker.requests[1].headers


async def test_unreachable_broker_is_retried() -> None:
    broker = Broker(
        sse(frame(1, "delta", text="a"), fail=drop()),
        httpx.ConnectError("connection refused"),
        httpx.ConnectError("connection refused"),
        sse(frame(2, "end")),
    )
    stats = AttachStats()
    events = await collect(broker, stats=stats)
    assert ids(events) == [eid(1), eid(2)]
    assert stats.reconnects == 3
    assert [r.headers.get("last-event-id") for r in broker.requests[1:]] == [eid(1)] * 3


async def test_id_only_block_moves_the_resume_point() -> None:
    broker = Broker(sse("id: " + eid(7) + "\n\n", fail=drop()), sse(frame(8, "end")))
    events = await collect(broker, offset="now")
    assert ids(events) == [eid(8)]
    assert broker.requests[1].headers["last-event-id"] == eid(7)


async def test_a_resume_point_event_moves_the_resume_point_and_is_not_yielded() -> None:
    resume = f'retry: 5\nid: {eid(7)}\nevent: resume_point\ndata: {{"offset": "{eid(7)}"}}\n\n'
    broker = Broker(
        sse(resume, fail=drop()),
        sse("retry: 5\n", ": ping\n", frame(8, "delta", text="a"), frame(9, "end")),
    )
    stats = AttachStats()
    events = await collect(broker, offset="now", stats=stats)
    assert ids(events) == [eid(8), eid(9)]
    assert broker.requests[1].headers["last-event-id"] == eid(7)
    assert (stats.events, stats.duplicates, stats.heartbeats) == (2, 0, 1)


@pytest.mark.parametrize(
    ("status", "code", "exc_type"),
    [
        (400, "bad_offset", BadRequest),
        (404, "stream_not_found", StreamNotFound),
        (410, "stream_expired", StreamExpired),
        (401, "bad_credentials", Unauthorized),
        (403, "wrong_stream", Forbidden),
        (418, "teapot", BrokerHTTPError),
    ],
)
async def test_client_errors_raise_at_once(
    status: int, code: str, exc_type: type[BrokerHTTPError]
) -> None:
    broker = Broker(error(status, code, "details here"))
    with pytest.raises(exc_type) as info:
        await collect(broker)
    assert type(info.value) is exc_type
    assert (info.value.status, info.value.code, info.value.message) == (
        status,
        code,
        "details here",
    )
    assert len(broker.requests) == 1


async def test_404_after_a_reconnect_is_not_retried() -> None:
    broker = Broker(sse(frame(1, "delta"), fail=drop()), error(404, "stream_not_found"))
    with pytest.raises(StreamNotFound):
        await collect(broker)
    assert len(broker.requests) == 2


async def test_gives_up_after_max_retries() -> None:
    broker = Broker(*(error(503, "redis_unavailable") for _ in range(4)))
    stats = AttachStats()
    with pytest.raises(ReattachExhausted) as info:
        await collect(broker, stats=stats)
    assert len(broker.requests) == FAST.max_retries + 1
    assert info.value.failures == FAST.max_retries + 1
    assert isinstance(info.value.__cause__, ServerError)
    assert info.value.last_error is info.value.__cause__
    assert stats.reconnects == FAST.max_retries


async def test_max_retries_zero_gives_up_on_first_failure() -> None:
    broker = Broker(httpx.ConnectError("refused"))
    with pytest.raises(ReattachExhausted) as info:
        await collect(broker, policy=AttachPolicy(max_retries=0))
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert len(broker.requests) == 1


async def test_gives_up_after_max_reconnect_time() -> None:
    policy = AttachPolicy(
        max_retries=1000, base_delay=0.01, max_delay=0.01, max_reconnect_time=0.05
    )
    broker = Broker(*(httpx.ConnectError("refused") for _ in range(1000)))
    with pytest.raises(ReattachExhausted):
        await collect(broker, policy=policy)
    # The time limit, not the count limit of 1000, ended it; waiting took more than one attempt.
    assert 1 < len(broker.requests) < 1000


async def test_reconnect_time_counts_from_the_last_progress() -> None:
    policy = AttachPolicy(
        max_retries=1000, base_delay=0.001, max_delay=0.001, max_reconnect_time=0.05
    )
    # Six slow connections take over 50 ms in all, but each one delivers an event.
    slow = [sse(frame(n, "delta"), fail=drop(), delay=0.015) for n in range(1, 7)]
    broker = Broker(*slow, sse(frame(7, "end")))
    events = await collect(broker, policy=policy)
    assert ids(events) == [eid(n) for n in range(1, 8)]


async def test_reconnect_time_limit_applies_after_progress() -> None:
    policy = AttachPolicy(
        max_retries=1000, base_delay=0.01, max_delay=0.01, max_reconnect_time=0.05
    )
    broker = Broker(
        sse(frame(1, "delta"), fail=drop()),
        *(httpx.ConnectError("refused") for _ in range(500)),
    )
    with pytest.raises(ReattachExhausted):
        await collect(broker, policy=policy)
    assert len(broker.requests) < 500


async def test_received_events_reset_the_failure_count() -> None:
    policy = AttachPolicy(max_retries=1, base_delay=0.0001, max_delay=0.001)
    broker = Broker(
        sse(frame(1, "delta"), fail=drop()),
        sse(frame(2, "delta"), fail=drop()),
        sse(frame(3, "delta"), fail=drop()),
        sse(frame(4, "end")),
    )
    events = await collect(broker, policy=policy)
    assert ids(events) == [eid(1), eid(2), eid(3), eid(4)]


async def test_heartbeats_reset_the_failure_count() -> None:
    # A quiet turn (e.g. waiting for a lost worker's lease to expire) whose responses keep getting
    # cut after a heartbeat must not exhaust the retries: the broker is evidently up.
    policy = AttachPolicy(max_retries=1, base_delay=0.0001, max_delay=0.001)
    broker = Broker(
        sse(frame(1, "delta")),
        sse(": ping\n\n"),
        sse(": ping\n\n"),
        sse(": ping\n\n"),
        sse(frame(2, "end")),
    )
    stats = AttachStats()
    events = await collect(broker, policy=policy, stats=stats)
    assert ids(events) == [eid(1), eid(2)]
    assert stats.heartbeats == 3
    assert stats.reconnects == 4


async def test_progress_on_an_earlier_connection_does_not_excuse_later_failures() -> None:
    policy = AttachPolicy(max_retries=1, base_delay=0.0001, max_delay=0.001)
    broker = Broker(
        sse(frame(1, "delta"), ": ping\n\n", fail=drop()),
        error(503, "redis_unavailable"),
        error(503, "redis_unavailable"),
    )
    with pytest.raises(ReattachExhausted) as info:
        await collect(broker, policy=policy)
    assert info.value.failures == 2
    assert len(broker.requests) == 2


async def test_duplicates_alone_are_not_progress() -> None:
    policy = AttachPolicy(max_retries=1, base_delay=0.0001, max_delay=0.001)
    broker = Broker(
        sse(frame(1, "delta"), fail=drop()),
        sse(frame(1, "delta"), fail=drop()),
    )
    with pytest.raises(ReattachExhausted) as info:
        await collect(broker, policy=policy)
    assert info.value.failures == 2


async def test_server_retry_field_is_the_backoff_base() -> None:
    # With the policy's own base the wait could last up to a minute; retry: 0 makes it zero.
    slow = AttachPolicy(max_retries=3, base_delay=60.0, max_delay=60.0)
    broker = Broker(
        sse("retry: 0\n\n", frame(1, "delta"), fail=drop()),
        sse(frame(2, "end")),
    )
    reconnects: list[ReconnectInfo] = []
    events = await collect(broker, policy=slow, on_reconnect=reconnects.append)
    assert ids(events) == [eid(1), eid(2)]
    assert [r.delay for r in reconnects] == [0.0]


def test_backoff_delay_is_full_jitter_capped() -> None:
    top = [backoff_delay(n, 0.5, 10.0, rand=lambda: 1.0) for n in range(1, 8)]
    assert top == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff_delay(3, 0.5, 10.0, rand=lambda: 0.0) == 0.0
    assert backoff_delay(3, 0.5, 10.0, rand=lambda: 0.25) == 0.5
    assert backoff_delay(10_000, 0.5, 10.0, rand=lambda: 1.0) == 10.0
    assert all(0.0 <= backoff_delay(4, 1.0, 3.0) <= 3.0 for _ in range(200))


# attach: stopping


async def test_stop_interrupts_a_quiet_stream() -> None:
    body_stream = sse(frame(1, "delta", text="a"), hang=True)
    broker = Broker(body_stream)
    stop = asyncio.Event()
    stats = AttachStats()
    received: list[Event] = []
    async with connect(broker) as client, asyncio.timeout(5):
        async for event in client.attach("s1", stop=stop, stats=stats):
            received.append(event)
            asyncio.get_running_loop().call_later(0.01, stop.set)
    assert ids(received) == [eid(1)]
    assert len(broker.requests) == 1
    # Stopping is not a failure: nothing may count it as a lost connection.
    assert (stats.reconnects, stats.failures) == (0, 0)


async def test_stop_interrupts_the_backoff_sleep() -> None:
    slow = AttachPolicy(max_retries=3, base_delay=60.0, max_delay=60.0)
    broker = Broker(error(503, "redis_unavailable"))
    stop = asyncio.Event()

    def on_reconnect(info: ReconnectInfo) -> None:
        asyncio.get_running_loop().call_later(0.01, stop.set)

    events = await collect(broker, policy=slow, stop=stop, on_reconnect=on_reconnect)
    assert events == []
    assert len(broker.requests) == 1


async def test_stop_set_before_attach_makes_no_request() -> None:
    broker = Broker()
    stop = asyncio.Event()
    stop.set()
    assert await collect(broker, stop=stop) == []
    assert broker.requests == []


async def test_breaking_out_closes_the_response() -> None:
    response = sse(frame(1, "delta"), frame(2, "delta"), hang=True)
    assert isinstance(response.stream, Body)
    body = response.stream
    broker = Broker(response)
    async with connect(broker) as client:
        stream = client.attach("s1")
        first = await anext(stream)
        await stream.aclose()
    assert first.id == eid(1)
    assert body.closed


# attach: malformed answers


async def test_non_event_stream_content_type_is_a_protocol_error() -> None:
    broker = Broker(httpx.Response(200, json={"events": []}))
    with pytest.raises(ProtocolError):
        await collect(broker)


async def test_non_json_event_data_is_a_protocol_error() -> None:
    broker = Broker(sse("id: 1\nevent: delta\ndata: not json\n\n"))
    with pytest.raises(ProtocolError):
        await collect(broker)


# one-shot requests


def turn_body(created_status: str = "running") -> dict[str, Any]:
    return {
        "turn_id": "t1",
        "conversation_id": "c1",
        "stream_id": "stream-t1",
        "status": created_status,
        "attempt": 1,
    }


async def test_start_turn_sends_only_given_fields() -> None:
    broker = Broker(httpx.Response(201, json=turn_body()))
    async with connect(broker) as client:
        turn = await client.start_turn(
            "c1", [{"role": "user", "content": "hi"}], model="m", params={"temperature": 0}
        )
    request = broker.requests[0]
    assert (request.method, request.url.path) == ("POST", "/v1/turns")
    assert json.loads(request.content) == {
        "conversation_id": "c1",
        "messages": [{"role": "user", "content": "hi"}],
        "model": "m",
        "params": {"temperature": 0},
    }
    assert turn.created
    assert (turn.turn_id, turn.conversation_id, turn.stream_id) == ("t1", "c1", "stream-t1")
    assert (turn.status, turn.attempt) == ("running", 1)
    assert turn.raw == turn_body()


async def test_start_turn_with_existing_turn_id_is_not_created() -> None:
    broker = Broker(httpx.Response(200, json=turn_body("complete")))
    async with connect(broker) as client:
        turn = await client.start_turn("c1", [], turn_id="t1")
    assert json.loads(broker.requests[0].content)["turn_id"] == "t1"
    assert not turn.created
    assert turn.status == "complete"


@pytest.mark.parametrize(
    ("status", "exc_type"), [(409, Conflict), (400, BadRequest), (422, BadRequest)]
)
async def test_start_turn_errors(status: int, exc_type: type[BrokerHTTPError]) -> None:
    broker = Broker(error(status, "turn_conflict", "different request"))
    async with connect(broker) as client:
        with pytest.raises(exc_type) as info:
            await client.start_turn("c1", [], turn_id="t1")
    assert info.value.code == "turn_conflict"
    assert info.value.message == "different request"


async def test_fastapi_validation_body_becomes_bad_request() -> None:
    detail = [{"loc": ["body", "messages"], "msg": "Field required"}]
    broker = Broker(httpx.Response(422, json={"detail": detail}))
    async with connect(broker) as client:
        with pytest.raises(BadRequest) as info:
            await client.start_turn("c1", [])
    assert info.value.code == "http_422"
    assert "Field required" in info.value.message


async def test_non_json_error_body_is_kept_as_message() -> None:
    broker = Broker(httpx.Response(502, text="Bad Gateway from proxy"))
    async with connect(broker) as client:
        with pytest.raises(ServerError) as info:
            await client.get_turn("t1")
    assert (info.value.status, info.value.code) == (502, "http_502")
    assert info.value.message == "Bad Gateway from proxy"


async def test_unreachable_broker_on_one_shot_request() -> None:
    broker = Broker(httpx.ConnectError("refused"))
    async with connect(broker) as client:
        with pytest.raises(BrokerConnectionError) as info:
            await client.start_turn("c1", [])
    assert isinstance(info.value.__cause__, httpx.ConnectError)


async def test_get_turn() -> None:
    broker = Broker(httpx.Response(200, json=turn_body()), error(404, "turn_not_found"))
    async with connect(broker) as client:
        assert await client.get_turn("t1") == turn_body()
        with pytest.raises(TurnNotFound) as info:
            await client.get_turn("missing")
    assert isinstance(info.value, NotFound)
    assert [r.url.path for r in broker.requests] == ["/v1/turns/t1", "/v1/turns/missing"]


async def test_catch_up_returns_a_page() -> None:
    body = {
        "events": [
            {"id": eid(1), "event": "delta", "data": {"attempt": 1, "text": "x"}},
            {"id": eid(2), "event": "end", "data": {"attempt": 1, "status": "complete"}},
        ],
        "next_offset": eid(2),
        "up_to_date": True,
        "closed": True,
    }
    broker = Broker(httpx.Response(200, json=body))
    async with connect(broker) as client:
        page = await client.catch_up("s1", offset=eid(0))
    params = broker.requests[0].url.params
    assert (params["format"], params["offset"]) == ("json", eid(0))
    assert [(e.id, e.type, e.attempt) for e in page.events] == [
        (eid(1), "delta", 1),
        (eid(2), "end", 1),
    ]
    assert page.events[0].data["text"] == "x"
    assert (page.next_offset, page.up_to_date, page.closed) == (eid(2), True, True)


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"events": []},
        {"events": [{"id": "1", "event": "delta", "data": "x"}], "next_offset": ""},
    ],
)
async def test_catch_up_rejects_malformed_pages(body: Any) -> None:
    broker = Broker(httpx.Response(200, json=body))
    async with connect(broker) as client:
        with pytest.raises(ProtocolError):
            await client.catch_up("s1")


async def test_catch_up_unknown_stream() -> None:
    broker = Broker(error(404, "stream_not_found"))
    async with connect(broker) as client:
        with pytest.raises(StreamNotFound):
            await client.catch_up("nope")


# command line


def test_cli_tail_prints_text_and_exits_0_on_complete(capsys: pytest.CaptureFixture[str]) -> None:
    broker = Broker(
        sse(
            "retry: 0\n\n",
            frame(1, "attempt", strategy="initial"),
            frame(2, "delta", text="Hello"),
            fail=drop(),
        ),
        sse(frame(3, "delta", text=" world"), frame(4, "end", status="complete", reason=None)),
    )
    code = main(["tail", "s1", "--url", BASE], transport=broker.transport())
    out, err = capsys.readouterr()
    assert code == 0
    # Redirected stdout is the exact answer: the reconnect note goes to stderr alone.
    assert out == "Hello world\n"
    assert "reconnecting" in err
    assert err.rstrip().endswith("status: complete")
    assert broker.requests[1].headers["last-event-id"] == eid(2)


def test_cli_tail_quiet_keeps_text_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    broker = Broker(
        sse("retry: 0\n\n", frame(1, "delta", text="Hello"), fail=drop()),
        sse(frame(2, "delta", text=" world"), frame(3, "end", status="complete")),
    )
    code = main(["tail", "s1", "--url", BASE, "--quiet"], transport=broker.transport())
    out, err = capsys.readouterr()
    assert code == 0
    assert out == "Hello world\n"
    assert err == "status: complete\n"


def test_cli_tail_exits_1_when_not_complete(capsys: pytest.CaptureFixture[str]) -> None:
    broker = Broker(
        sse(
            frame(1, "delta", text="partial"),
            frame(2, "error", code="provider_error", message="boom", retryable=False),
            frame(3, "end", status="failed", reason="provider_error"),
        )
    )
    code = main(["tail", "s1", "--url", BASE, "--offset", "-1"], transport=broker.transport())
    out, err = capsys.readouterr()
    assert code == 1
    assert out == "partial\n"
    assert "error provider_error: boom" in err
    assert "status: failed (provider_error)" in err


def test_cli_tail_shows_regenerated_attempt_on_a_new_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker = Broker(
        sse(
            frame(1, "delta", text="first try"),
            frame(2, "end", status="interrupted"),
            frame(3, "attempt", 2, strategy="regenerate"),
            frame(4, "delta", 2, text="second"),
            frame(5, "end", 2, status="complete"),
        )
    )
    code = main(["tail", "s1", "--url", BASE], transport=broker.transport())
    out, err = capsys.readouterr()
    assert code == 0
    assert out == "first try\nsecond\n"
    assert "[attempt 2: regenerate]" in err


def test_cli_tail_unknown_stream_exits_2_without_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker = Broker(error(404, "stream_not_found", "no such stream"))
    code = main(["tail", "gone", "--url", BASE], transport=broker.transport())
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert "no such stream" in err
    assert "Traceback" not in err


def test_cli_tail_gives_up_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    broker = Broker(httpx.ConnectError("refused"))
    argv = ["tail", "s1", "--url", BASE, "--max-retries", "0"]
    code = main(argv, transport=broker.transport())
    _, err = capsys.readouterr()
    assert code == 2
    assert "gave up" in err


def test_cli_start_prints_turn_json(capsys: pytest.CaptureFixture[str]) -> None:
    broker = Broker(httpx.Response(201, json=turn_body()))
    argv = ["start", "--conversation", "c1", "--url", BASE, "--model", "m", "Say hi"]
    code = main(argv, transport=broker.transport())
    out, _ = capsys.readouterr()
    assert code == 0
    assert json.loads(out) == turn_body()
    assert json.loads(broker.requests[0].content) == {
        "conversation_id": "c1",
        "messages": [{"role": "user", "content": "Say hi"}],
        "model": "m",
    }


def test_cli_start_then_tail(capsys: pytest.CaptureFixture[str]) -> None:
    broker = Broker(
        httpx.Response(201, json=turn_body()),
        sse(frame(1, "delta", text="hi"), frame(2, "end", status="cancelled")),
    )
    argv = ["start", "--conversation", "c1", "--url", BASE, "--tail", "Say hi"]
    code = main(argv, transport=broker.transport())
    out, err = capsys.readouterr()
    assert code == 1
    assert out.endswith("}\nhi\n")
    assert "status: cancelled" in err
    assert broker.requests[1].url.path == "/v1/streams/stream-t1"
