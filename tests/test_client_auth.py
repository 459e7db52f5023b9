"""The Python client against a real broker with credentials: API keys, attach tokens, refusals."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import jwt
import pytest

from broker_client import (
    AttachPolicy,
    AttachStats,
    BrokerClient,
    Conflict,
    Forbidden,
    RateLimited,
    StreamNotFound,
    TurnText,
    Unauthorized,
)
from broker_client.__main__ import main
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import bearer, start_turn, wait_final

KEY = "key-acme-0123456789abcdef"
OTHER_KEY = "key-globex-0123456789abcdef"
ATTACH_SECRET = "a" * 40
FAST = AttachPolicy(max_retries=20, base_delay=0.02, max_delay=0.1, read_timeout=10)
USER = [{"role": "user", "content": "hello"}]


def secured(factory: BrokerFactory, **overrides: Any) -> RunningBroker:
    settings: dict[str, Any] = {
        "api_keys": f"acme={KEY},globex={OTHER_KEY}",
        "attach_secret": ATTACH_SECRET,
    }
    return factory(**{**settings, **overrides})


def client(broker: RunningBroker, api_key: str | None = KEY) -> BrokerClient:
    return BrokerClient(broker.base_url, api_key=api_key, policy=FAST, timeout=10)


async def read_all(
    c: BrokerClient, stream_id: str, token: str | None = None, stats: AttachStats | None = None
) -> TurnText:
    text = TurnText()
    async with asyncio.timeout(30):
        async for event in c.attach(stream_id, token=token, stats=stats):
            text.feed(event)
    return text


def forged(stream_id: str, *, secret: str = ATTACH_SECRET, expires_in: int = 300) -> str:
    """An attach token as the broker signs them (the tests know its secret)."""
    now = int(time.time())
    claims = {
        "aud": "broker-attach",
        "sid": stream_id,
        "ten": "acme",
        "iat": now,
        "exp": now + expires_in,
        "jti": "forged0000000000",
    }
    return jwt.encode(claims, secret, algorithm="HS256")


async def test_an_api_key_starts_attaches_and_reads_the_whole_answer(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory)
    async with client(broker) as owner:
        turn = await owner.start_turn(
            "conv", USER, turn_id="keyed", params={"simulate": {"tokens": 30, "tokens_per_s": 0}}
        )
        assert turn.created
        text = await read_all(owner, turn.stream_id)
        state = await owner.get_turn("keyed")
    assert text.status == "complete"
    assert text.text
    assert text.text == state["canonical"]["text"]


async def test_a_minted_token_reads_the_stream_without_a_key(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory)
    async with client(broker) as owner, client(broker, api_key=None) as anonymous:
        turn = await owner.start_turn(
            "conv", USER, turn_id="shared", params={"simulate": {"tokens": 20, "tokens_per_s": 0}}
        )
        minted = await owner.mint_attach_token("shared", ttl_s=120)
        assert (minted.turn_id, minted.stream_id, minted.one_viewer) == (
            "shared",
            turn.stream_id,
            False,
        )
        assert time.time() + 100 < minted.expires_at <= time.time() + 121
        assert minted.stream_url.startswith(f"{broker.base_url}/v1/streams/{turn.stream_id}?")

        # Without the token, the anonymous client is refused; with it, it reads everything.
        with pytest.raises(Unauthorized) as refused:
            await read_all(anonymous, turn.stream_id)
        assert refused.value.code == "unauthorized"
        viewer = await read_all(anonymous, turn.stream_id, token=minted.token)
        page = await anonymous.catch_up(turn.stream_id, token=minted.token)
        owners = await read_all(owner, turn.stream_id)
    assert viewer.status == "complete"
    assert viewer.text == owners.text
    assert "".join(e.data["text"] for e in page.events if e.type == "delta") == owners.text
    # The absolute link works for a reader that sends no headers at all.
    with httpx.stream("GET", minted.stream_url, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")


async def test_an_attach_token_reads_only_its_stream_and_acts_on_nothing(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory)
    async with client(broker) as owner:
        first = await owner.start_turn(
            "conv", USER, turn_id="one", params={"simulate": {"tokens": 3}}
        )
        second = await owner.start_turn(
            "conv", USER, turn_id="two", params={"simulate": {"tokens": 3}}
        )
        minted = await owner.mint_attach_token("one")
    async with client(broker, api_key=None) as anonymous, client(broker, minted.token) as holder:
        with pytest.raises(Forbidden) as wrong:
            await read_all(anonymous, second.stream_id, token=minted.token)
        assert (wrong.value.status, wrong.value.code) == (403, "wrong_stream")
        for act in (
            holder.get_turn("one"),
            holder.start_turn("conv", USER, turn_id="three"),
            holder.mint_attach_token("one"),
        ):
            with pytest.raises(Forbidden) as read_only:
                await act
            assert read_only.value.code == "read_only"
        # As a bearer credential instead of ?token=, it reads its own stream all the same.
        assert (await read_all(holder, first.stream_id)).status == "complete"


async def test_refused_credentials_raise_unauthorized_with_the_code_and_no_retry(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory)
    turn = start_turn(broker.base_url, "conv", auth=KEY, tokens=3)
    async with client(broker, api_key="key-wrong-0123456789abcdef") as wrong:
        with pytest.raises(Unauthorized) as info:
            await wrong.start_turn("conv", USER)
        assert (info.value.status, info.value.code) == (401, "bad_credentials")
        assert "key-wrong" not in str(info.value)
        stats = AttachStats()
        with pytest.raises(Unauthorized) as attached:
            await read_all(wrong, turn["stream_id"], stats=stats)
        assert attached.value.code == "bad_credentials"
        assert stats.reconnects == 0
    async with client(broker, api_key=None) as anonymous:
        with pytest.raises(Unauthorized) as missing:
            await anonymous.get_turn(turn["turn_id"])
        assert missing.value.code == "unauthorized"
        with pytest.raises(Unauthorized) as expired:
            await anonymous.catch_up(
                turn["stream_id"], token=forged(turn["stream_id"], expires_in=-60)
            )
        assert expired.value.code == "token_expired"
        with pytest.raises(Unauthorized) as bad:
            await read_all(
                anonymous, turn["stream_id"], token=forged(turn["stream_id"], secret="b" * 40)
            )
        assert bad.value.code == "bad_token"
        # The control: the same claims signed with the broker's secret are accepted.
        assert (
            await read_all(anonymous, turn["stream_id"], token=forged(turn["stream_id"]))
        ).status


async def test_another_tenants_stream_is_not_found(broker_factory: BrokerFactory) -> None:
    broker = secured(broker_factory)
    turn = start_turn(broker.base_url, "conv", auth=KEY, tokens=3)
    async with client(broker, api_key=OTHER_KEY) as other:
        with pytest.raises(StreamNotFound):
            await read_all(other, turn["stream_id"])


async def test_a_one_viewer_tokens_newest_reader_takes_over_and_the_first_stops(
    broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("broker.viewer.VIEWER_LEASE_MS", 900)  # renewed every 0.3 s
    broker = secured(broker_factory)
    turn = start_turn(broker.base_url, "conv", auth=KEY, tokens=400, tokens_per_s=40)
    async with client(broker) as owner, client(broker, api_key=None) as anonymous:
        minted = await owner.mint_attach_token(turn["turn_id"], one_viewer=True)
        assert minted.one_viewer
        with pytest.raises(Forbidden) as json_read:
            await anonymous.catch_up(turn["stream_id"], token=minted.token)
        assert json_read.value.code == "sse_only"
        first_event = asyncio.Event()
        done = asyncio.Event()

        async def first_viewer() -> None:
            async for _ in anonymous.attach(turn["stream_id"], token=minted.token, stop=done):
                first_event.set()

        first = asyncio.create_task(first_viewer())
        second_reads = asyncio.Event()

        async def second_viewer() -> None:
            async for _ in anonymous.attach(turn["stream_id"], token=minted.token, stop=done):
                if first.done():
                    second_reads.set()  # still reading after the first was let go

        second: asyncio.Task[None] | None = None
        try:
            async with asyncio.timeout(10):
                await first_event.wait()
            second = asyncio.create_task(second_viewer())
            # The newer reader took the token over: the first is told, and does not come back.
            with pytest.raises(Conflict) as replaced:
                async with asyncio.timeout(10):
                    await first
            assert replaced.value.code == "viewer_replaced"
            async with asyncio.timeout(10):
                await second_reads.wait()
        finally:
            done.set()
            await asyncio.gather(first, *([second] if second else []), return_exceptions=True)
    async with httpx.AsyncClient(headers=bearer(KEY), timeout=10) as http:
        cancelled = await http.post(f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel")
    assert cancelled.status_code == 200


async def test_turn_limits_raise_rate_limited_with_retry_after(
    broker_factory: BrokerFactory,
) -> None:
    broker = secured(broker_factory, turn_rate_per_s=0.2, turn_burst=1)
    async with client(broker) as owner:
        await owner.start_turn("conv", USER, turn_id="first", params={"simulate": {"tokens": 2}})
        with pytest.raises(RateLimited) as info:
            await owner.start_turn("conv", USER, turn_id="second")
    assert (info.value.status, info.value.code) == (429, "rate_limited")
    assert info.value.retry_after is not None
    assert 1 <= info.value.retry_after <= 5


async def test_attach_tokens_work_on_an_open_broker(broker: RunningBroker) -> None:
    async with client(broker, api_key=None) as anyone:
        turn = await anyone.start_turn("conv", USER, params={"simulate": {"tokens": 5}})
        minted = await anyone.mint_attach_token(turn.turn_id)
        with_token = await read_all(anyone, turn.stream_id, token=minted.token)
        without = await read_all(anyone, turn.stream_id)
    assert with_token.status == "complete"
    assert with_token.text == without.text


def test_cli_takes_the_key_from_the_environment_and_shares_a_token(
    broker_factory: BrokerFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker = secured(broker_factory)
    url = ["--url", broker.base_url]
    monkeypatch.delenv("BROKER_API_KEY", raising=False)
    assert main(["start", "--conversation", "cli", "--turn-id", "cli-1", *url, "hi"]) == 2
    assert "401 unauthorized" in capsys.readouterr().err
    monkeypatch.setenv("BROKER_API_KEY", KEY)
    assert main(["start", "--conversation", "cli", "--turn-id", "cli-1", "--tail", *url, "hi"]) == 0
    printed = capsys.readouterr().out
    final = wait_final(broker.base_url, "cli-1", auth=KEY)
    assert printed.endswith(final["canonical"]["text"] + "\n")
    assert main(["share", "cli-1", *url]) == 0
    shared = json.loads(capsys.readouterr().out)
    monkeypatch.delenv("BROKER_API_KEY")
    assert main(["tail", shared["stream_id"], "--token", shared["token"], *url]) == 0
    assert capsys.readouterr().out == final["canonical"]["text"] + "\n"
    # A wrong key from the flag beats the environment's right one, and fails with its code.
    monkeypatch.setenv("BROKER_API_KEY", KEY)
    assert main(["tail", shared["stream_id"], "--api-key", "key-wrong-0123456789abcdef", *url]) == 2
    assert "bad_credentials" in capsys.readouterr().err
