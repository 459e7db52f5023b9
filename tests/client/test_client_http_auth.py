"""The client's credentials against a scripted in-memory broker: API keys, attach tokens, refusals.

What a real broker answers is pinned in tests/test_client_auth.py; here the broker is scripted so
that each reconnect rule (401/403 fatal, 429 waits out `Retry-After`, a lingering one-viewer
lock) can be driven exactly.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from email.utils import formatdate
from typing import Any

import httpx
import pytest

from broker_client import (
    AttachPolicy,
    AttachToken,
    BrokerClient,
    Conflict,
    Event,
    Forbidden,
    ProtocolError,
    RateLimited,
    ReattachExhausted,
    ReconnectInfo,
    ServerError,
    Unauthorized,
)
from broker_client.__main__ import main
from broker_client.errors import parse_retry_after
from tests.client.scripted import BASE, FAST, Broker, drop, eid, error, frame, sse

KEY = "key-acme-0123456789abcdef"


@asynccontextmanager
async def connect(
    broker: Broker, *, api_key: str | None = KEY, policy: AttachPolicy = FAST
) -> AsyncIterator[BrokerClient]:
    async with (
        httpx.AsyncClient(transport=broker.transport()) as http,
        BrokerClient(BASE, http=http, policy=policy, api_key=api_key) as client,
    ):
        yield client


async def collect(
    broker: Broker,
    *,
    token: str | None = None,
    policy: AttachPolicy = FAST,
    on_reconnect: Callable[[ReconnectInfo], None] | None = None,
) -> list[Event]:
    async with connect(broker, policy=policy) as client, asyncio.timeout(10):
        return [
            event async for event in client.attach("st_1", token=token, on_reconnect=on_reconnect)
        ]


def minted_body(token: str = "tok.en.x") -> dict[str, Any]:
    return {
        "token": token,
        "turn_id": "t1",
        "stream_id": "st_1",
        "expires_at": 1_900_000_000,
        "one_viewer": True,
        "links": {"stream": f"/v1/streams/st_1?token={token}"},
    }


# the credential on every call


async def test_api_key_is_sent_as_a_bearer_credential_on_every_call() -> None:
    turn = {"turn_id": "t1", "conversation_id": "c", "stream_id": "st_1", "status": "queued"}
    page = {"events": [], "next_offset": eid(0), "up_to_date": True, "closed": False}
    broker = Broker(
        httpx.Response(201, json=turn),
        httpx.Response(200, json=turn),
        httpx.Response(200, json=page),
        httpx.Response(201, json=minted_body()),
        sse(frame(1, "delta", text="a"), fail=drop()),
        sse(frame(2, "end", status="complete")),
    )
    async with connect(broker) as client:
        await client.start_turn("c", [{"role": "user", "content": "hi"}])
        await client.get_turn("t1")
        await client.catch_up("st_1")
        await client.mint_attach_token("t1")
        events = [event async for event in client.attach("st_1")]
    assert [e.type for e in events] == ["delta", "end"]
    assert len(broker.requests) == 6
    for request in broker.requests:
        assert request.headers["authorization"] == f"Bearer {KEY}"
        assert "token" not in request.url.params


async def test_no_api_key_sends_no_authorization() -> None:
    broker = Broker(httpx.Response(200, json={"turn_id": "t1"}))
    async with connect(broker, api_key=None) as client:
        await client.get_turn("t1")
    assert "authorization" not in broker.requests[0].headers


def test_api_key_and_an_authorization_header_together_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        BrokerClient(BASE, api_key=KEY, headers={"authorization": "Bearer other"})
    with pytest.raises(ValueError, match="single-line"):
        BrokerClient(BASE, api_key="key\r\nX-Injected: 1")


async def test_a_read_with_a_token_sends_the_token_alone_on_every_connection() -> None:
    page = {"events": [], "next_offset": eid(0), "up_to_date": True, "closed": True}
    broker = Broker(
        httpx.Response(200, json=page),
        sse(frame(1, "delta", text="a"), fail=drop()),
        sse(frame(2, "end", status="complete")),
    )
    async with connect(broker) as client:
        await client.catch_up("st_1", token="tok/en+1")
        events = [event async for event in client.attach("st_1", token="tok/en+1")]
    assert [e.id for e in events] == [eid(1), eid(2)]
    for request in broker.requests:
        assert request.url.params["token"] == "tok/en+1"
        assert "authorization" not in request.headers
    assert broker.requests[0].url.params["format"] == "json"
    # The reconnect keeps the token and resumes after the last event.
    assert broker.requests[2].headers["last-event-id"] == eid(1)


async def test_mint_attach_token_posts_its_options_and_returns_a_typed_token() -> None:
    broker = Broker(
        httpx.Response(201, json=minted_body("sec.ret.tok")),
        httpx.Response(201, json={**minted_body(), "one_viewer": False}),
    )
    async with connect(broker) as client:
        minted = await client.mint_attach_token("turn/1", ttl_s=90.5, one_viewer=True)
        default = await client.mint_attach_token("t1")
    first, second = broker.requests
    assert (first.method, first.url.raw_path) == ("POST", b"/v1/turns/turn%2F1/attach-tokens")
    assert json.loads(first.content) == {"ttl_s": 90.5, "one_viewer": True}
    assert json.loads(second.content) == {"one_viewer": False}
    assert isinstance(minted, AttachToken)
    assert (minted.token, minted.turn_id, minted.stream_id) == ("sec.ret.tok", "t1", "st_1")
    assert (minted.expires_at, minted.one_viewer) == (1_900_000_000, True)
    assert minted.stream_url == f"{BASE}/v1/streams/st_1?token=sec.ret.tok"
    assert "sec.ret.tok" not in repr(minted)  # a credential stays out of logs
    assert not default.one_viewer


@pytest.mark.parametrize(
    "body", [[], {"stream_id": "st_1", "expires_at": 1}, {**minted_body(), "expires_at": None}]
)
async def test_a_malformed_mint_answer_is_a_protocol_error(body: Any) -> None:
    broker = Broker(httpx.Response(201, json=body))
    async with connect(broker) as client:
        with pytest.raises(ProtocolError):
            await client.mint_attach_token("t1")


# refusals


@pytest.mark.parametrize(
    ("status", "code", "exc_type"),
    [
        (401, "bad_credentials", Unauthorized),
        (401, "token_expired", Unauthorized),
        (403, "read_only", Forbidden),
        (403, "wrong_stream", Forbidden),
    ],
)
async def test_refused_credentials_on_a_reconnect_end_attach_at_once(
    status: int, code: str, exc_type: type[Exception]
) -> None:
    broker = Broker(
        sse(frame(1, "delta", text="a"), fail=drop()),
        error(status, code, headers={"www-authenticate": "Bearer"} if status == 401 else None),
    )
    with pytest.raises(exc_type) as info:
        await collect(broker, token="t.o.k")
    assert getattr(info.value, "code", None) == code
    assert getattr(info.value, "status", None) == status
    assert len(broker.requests) == 2  # no third try


async def test_429_on_start_turn_is_rate_limited_with_its_retry_after() -> None:
    broker = Broker(error(429, "too_many_streams", headers={"retry-after": "7"}))
    async with connect(broker) as client:
        with pytest.raises(RateLimited) as info:
            await client.start_turn("c", [])
    assert (info.value.status, info.value.code, info.value.retry_after) == (
        429,
        "too_many_streams",
        7.0,
    )
    assert len(broker.requests) == 1  # one-shot calls leave the retry to the caller


def test_retry_after_is_read_as_seconds_or_as_a_date() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-5") == 0.0
    assert parse_retry_after("nan") is None
    in_a_minute = parse_retry_after(formatdate(time.time() + 60, usegmt=True))
    assert in_a_minute is not None
    assert 55 <= in_a_minute <= 61
    assert parse_retry_after(formatdate(time.time() - 60, usegmt=True)) == 0.0


async def test_attach_waits_out_retry_after_on_429() -> None:
    broker = Broker(
        error(429, "rate_limited", headers={"retry-after": "1"}),
        sse(frame(1, "end", status="complete")),
    )
    reconnects: list[ReconnectInfo] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    events = await collect(broker, on_reconnect=reconnects.append)
    elapsed = loop.time() - started
    assert [e.type for e in events] == ["end"]
    assert len(reconnects) == 1
    assert isinstance(reconnects[0].error, RateLimited)
    assert reconnects[0].error.retry_after == 1.0
    # FAST's backoff would be a fraction of a millisecond: the server's Retry-After rules.
    assert reconnects[0].delay >= 1.0
    assert elapsed >= 0.95


async def test_429_without_retry_after_waits_at_least_the_base() -> None:
    policy = AttachPolicy(max_retries=3, base_delay=0.2, max_delay=0.2)
    broker = Broker(error(429, "rate_limited"), sse(frame(1, "end", status="complete")))
    reconnects: list[ReconnectInfo] = []
    await collect(broker, policy=policy, on_reconnect=reconnects.append)
    assert [r.delay for r in reconnects] == [0.2]


async def test_503_retry_after_is_honoured_too() -> None:
    broker = Broker(
        error(503, "redis_unavailable", headers={"retry-after": "1"}),
        sse(frame(1, "end", status="complete")),
    )
    reconnects: list[ReconnectInfo] = []
    await collect(broker, on_reconnect=reconnects.append)
    assert isinstance(reconnects[0].error, ServerError)
    assert reconnects[0].delay >= 1.0


async def test_a_retry_after_beyond_the_policy_ends_attach_with_the_429() -> None:
    policy = AttachPolicy(max_retries=3, base_delay=0.0001, max_delay=0.001, max_retry_after=5)
    broker = Broker(error(429, "rate_limited", headers={"retry-after": "3600"}))
    with pytest.raises(RateLimited) as info:
        await collect(broker, policy=policy)
    assert info.value.retry_after == 3600.0
    assert len(broker.requests) == 1


async def test_repeated_429s_give_up_after_max_retries() -> None:
    policy = AttachPolicy(max_retries=2, base_delay=0.01, max_delay=0.01)
    broker = Broker(*(error(429, "rate_limited") for _ in range(3)))
    with pytest.raises(ReattachExhausted) as info:
        await collect(broker, policy=policy)
    assert isinstance(info.value.last_error, RateLimited)
    assert len(broker.requests) == 3


# one-viewer tokens


async def test_token_in_use_on_the_first_connection_is_a_conflict() -> None:
    broker = Broker(error(409, "token_in_use"))
    with pytest.raises(Conflict) as info:
        await collect(broker, token="t.o.k")
    assert info.value.code == "token_in_use"
    assert len(broker.requests) == 1


async def test_token_in_use_after_our_own_drop_is_waited_out() -> None:
    # The broker frees a one-viewer lock once it notices the cut connection; until then our own
    # earlier connection is the viewer in the way.
    broker = Broker(
        sse(frame(1, "delta", text="a"), fail=drop()),
        error(409, "token_in_use"),
        sse(frame(2, "end", status="complete")),
    )
    reconnects: list[ReconnectInfo] = []
    events = await collect(broker, token="t.o.k", on_reconnect=reconnects.append)
    assert [e.id for e in events] == [eid(1), eid(2)]
    assert isinstance(reconnects[1].error, Conflict)
    assert broker.requests[2].headers["last-event-id"] == eid(1)


async def test_other_conflicts_after_a_drop_still_raise() -> None:
    broker = Broker(sse(frame(1, "delta", text="a"), fail=drop()), error(409, "turn_conflict"))
    with pytest.raises(Conflict):
        await collect(broker)
    assert len(broker.requests) == 2


# command line


def test_cli_sends_the_api_key_from_the_flag_or_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    turn = {"turn_id": "t1", "conversation_id": "c", "stream_id": "st_1", "status": "queued"}
    monkeypatch.setenv("BROKER_API_KEY", "from-the-environment-0123")
    broker = Broker(httpx.Response(201, json=turn), httpx.Response(201, json=turn))
    assert (
        main(["start", "--conversation", "c", "--url", BASE, "hi"], transport=broker.transport())
        == 0
    )
    argv = ["start", "--conversation", "c", "--url", BASE, "--api-key", KEY, "hi"]
    assert main(argv, transport=broker.transport()) == 0
    capsys.readouterr()
    assert broker.requests[0].headers["authorization"] == "Bearer from-the-environment-0123"
    assert broker.requests[1].headers["authorization"] == f"Bearer {KEY}"


def test_cli_refused_key_exits_2_with_the_code_and_without_the_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker = Broker(error(401, "bad_credentials", headers={"www-authenticate": "Bearer"}))
    argv = ["tail", "st_1", "--url", BASE, "--api-key", KEY]
    assert main(argv, transport=broker.transport()) == 2
    out, err = capsys.readouterr()
    assert "bad_credentials" in err
    assert KEY not in out + err
    assert len(broker.requests) == 1


def test_cli_share_prints_the_token_and_tail_reads_with_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker = Broker(
        httpx.Response(201, json=minted_body("a.b.c")),
        sse(frame(1, "delta", text="hello"), frame(2, "end", status="complete")),
    )
    argv = ["share", "t1", "--url", BASE, "--api-key", KEY, "--ttl", "60", "--one-viewer"]
    assert main(argv, transport=broker.transport()) == 0
    shared = json.loads(capsys.readouterr().out)
    assert shared["token"] == "a.b.c"
    assert shared["stream_url"] == f"{BASE}/v1/streams/st_1?token=a.b.c"
    assert json.loads(broker.requests[0].content) == {"ttl_s": 60.0, "one_viewer": True}
    argv = ["tail", "st_1", "--url", BASE, "--token", shared["token"]]
    assert main(argv, transport=broker.transport()) == 0
    assert capsys.readouterr().out == "hello\n"
    assert broker.requests[1].url.params["token"] == "a.b.c"
    assert "authorization" not in broker.requests[1].headers


def test_cli_refuses_a_multi_line_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["tail", "st_1", "--url", BASE, "--api-key", "a\nb"])
    assert info.value.code == 2
    assert "one non-empty line" in capsys.readouterr().err
