"""The approval scripts' contracts on a real Redis: request, decide (compare-and-set), park."""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.approval_rules import ApprovalRule, set_clock
from broker.approvals import Approvals
from broker.deps import Deps
from broker.errors import FencedWrite
from broker.keys import Keys
from broker.ledger import Dispatcher, Ledger, Slot
from broker.metrics import Metrics
from broker.scripts import Scripts
from broker.settings import Settings
from broker.tools import Tool, ToolRegistry

_n = itertools.count()


class Recorder:
    """A Python tool that records its calls."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    async def __call__(self, arguments: dict[str, Any], key: str) -> Any:
        self.keys.append(key)
        return {"n": len(self.keys)}


class Setup:
    def __init__(self, aredis: Redis, **overrides: Any) -> None:
        prefix = f"approve{os.getpid()}-{next(_n)}"
        settings = Settings(redis_url="unix:///unused", key_prefix=prefix, **overrides)
        self.deps = Deps(aredis, Scripts(aredis), Keys(prefix), settings, Metrics())
        self.tool = Recorder()
        tool = Tool(
            name="pay",
            kind="unkeyed_write",
            schema={"type": "object"},
            function=self.tool,
            approval=ApprovalRule("always"),
        )
        self.dispatcher = Dispatcher(
            ToolRegistry([tool]), Ledger(self.deps), httpx.AsyncClient(), settings, Metrics()
        )
        self.enqueued: list[tuple[str, str, int]] = []
        self.approvals = Approvals(self.deps, self._enqueue)
        self.slot = Slot("c", "turn", "pay", 0)

    async def _enqueue(self, conversation_id: str, turn_id: str, attempt: int) -> None:
        self.enqueued.append((conversation_id, turn_id, attempt))

    async def request(self) -> str:
        outcome = await self.dispatcher.dispatch(self.slot, '{"amount": 5}', {})
        assert outcome.source == "awaiting"
        assert outcome.approval is not None
        return outcome.approval.approval_id


async def test_a_call_waits_once_then_runs_once_when_approved(aredis: Redis) -> None:
    setup = Setup(aredis)
    approval_id = await setup.request()
    assert await setup.request() == approval_id, "the same slot: the same pending request"
    assert setup.tool.keys == []
    decided = await setup.approvals.decide("c", "turn", approval_id, "approve", None)
    assert (decided.decision, decided.by, decided.new) == ("approve", "person", True)
    ran = await setup.dispatcher.dispatch(setup.slot, '{"amount": 5}', {})
    assert (ran.source, ran.result) == ("ran", {"n": 1})
    replayed = await setup.dispatcher.dispatch(setup.slot, '{"amount": 5}', {})
    assert (replayed.source, replayed.result) == ("replayed", {"n": 1})
    assert len(setup.tool.keys) == 1
    assert setup.enqueued == [], "no turn was parked on it: nothing to resume"


async def test_a_denied_call_never_runs_and_its_refusal_is_replayed(aredis: Redis) -> None:
    setup = Setup(aredis)
    approval_id = await setup.request()
    await setup.approvals.decide("c", "turn", approval_id, "deny", "not today")
    for _ in range(2):
        outcome = await setup.dispatcher.dispatch(setup.slot, '{"amount": 5}', {})
        assert outcome.source == "replayed"
        assert outcome.fail_reason is None  # the model is told and goes on
        assert outcome.error is not None
        assert outcome.error["code"] == "approval_denied"
        assert "not today" in outcome.error["message"]
    assert setup.tool.keys == []


async def test_other_arguments_in_a_waiting_slot_are_a_mismatch(aredis: Redis) -> None:
    setup = Setup(aredis)
    await setup.request()
    outcome = await setup.dispatcher.dispatch(setup.slot, '{"amount": 6}', {})
    assert outcome.fail_reason == "args_mismatch"
    assert setup.tool.keys == []


@pytest.mark.parametrize("rounds", [100])
async def test_concurrent_decisions_compare_and_set_one_winner(aredis: Redis, rounds: int) -> None:
    for _ in range(rounds):
        setup = Setup(aredis)
        approval_id = await setup.request()
        wishes = ["approve", "deny"] * 4
        answers = await asyncio.gather(
            *(setup.approvals.decide("c", "turn", approval_id, wish, None) for wish in wishes)
        )
        assert sum(answer.new for answer in answers) == 1
        assert len({answer.decision for answer in answers}) == 1


async def park(setup: Setup, approval_ids: list[str], token: str = "7", attempt: int = 1) -> str:
    keys = setup.deps.keys
    reply = await setup.deps.scripts.park_attempt(
        turn=keys.turn("c", "turn"),
        lease=keys.lease("c", "turn"),
        waiting=keys.approvals_waiting("c", "turn"),
        approvals=[(keys.approval("c", "turn", ident), ident) for ident in approval_ids],
        token=token,
        attempt=attempt,
        record='{"n": 1, "parked": {}}',
        text="so far",
    )
    return reply.result


async def leased(setup: Setup, *, cancel: bool = False) -> None:
    keys, redis = setup.deps.keys, setup.deps.redis
    await redis.hset(keys.turn("c", "turn"), mapping={"status": "streaming", "attempt": 1})
    await redis.hset(keys.turn("c", "turn"), "fence", 7)
    await redis.hset(keys.lease("c", "turn"), "token", "7")
    if cancel:
        await redis.hset(keys.lease("c", "turn"), "cancel", "1")


async def test_park_lets_go_and_the_last_decision_queues_the_turn_again(aredis: Redis) -> None:
    setup = Setup(aredis)
    first = await setup.request()
    setup.slot = Slot("c", "turn", "pay", 1)
    second = await setup.request()
    await leased(setup)
    assert await park(setup, [first, second]) == "parked"
    keys = setup.deps.keys
    turn = await aredis.hgetall(keys.turn("c", "turn"))
    assert turn["status"] == "awaiting_approval"
    assert turn["text:1"] == "so far"
    assert not await aredis.exists(keys.lease("c", "turn"))
    assert await park(setup, [first, second]) == "parked", "sent again: its own park"
    with pytest.raises(FencedWrite):
        await park(setup, [first, second], token="8")
    await setup.approvals.decide("c", "turn", first, "approve", None)
    assert setup.enqueued == []
    assert (await aredis.hget(keys.turn("c", "turn"), "status")) == "awaiting_approval"
    await setup.approvals.decide("c", "turn", second, "deny", None)
    assert setup.enqueued == [("c", "turn", 1)]
    assert (await aredis.hget(keys.turn("c", "turn"), "status")) == "queued"
    kinds = [fields["e"] for _, fields in await rc.xrange(aredis, keys.events("c", "turn"), "-")]
    assert kinds == ["approval_decision", "approval_decision"]


async def test_park_goes_on_when_all_were_decided_and_stops_when_asked(aredis: Redis) -> None:
    setup = Setup(aredis)
    approval_id = await setup.request()
    await leased(setup)
    await setup.approvals.decide("c", "turn", approval_id, "approve", None)
    assert await park(setup, [approval_id]) == "decided"
    keys = setup.deps.keys
    assert (await aredis.hget(keys.turn("c", "turn"), "status")) == "streaming"
    # While the writer holds the lease, the decision's event is counted in its base.
    assert (await aredis.hget(keys.lease("c", "turn"), "base")) == "1"
    setup.slot = Slot("c", "turn", "pay", 1)
    other = await setup.request()
    await leased(setup, cancel=True)
    assert await park(setup, [other]) == "stop"
    assert (await aredis.hget(keys.turn("c", "turn"), "status")) == "streaming"


async def test_a_request_met_again_is_put_back_in_the_expiry_index(aredis: Redis) -> None:
    setup = Setup(aredis)
    approval_id = await setup.request()
    index = setup.deps.keys.approval_expiry()
    member = f"c turn {approval_id}"
    expires = await aredis.zscore(index, member)
    assert expires is not None
    await aredis.zrem(index, member)  # as if the process died between the request and this
    assert await setup.request() == approval_id
    assert await aredis.zscore(index, member) == expires
    with set_clock(lambda: expires / 1000 + 1):
        assert await setup.approvals.sweep() == 1
    assert await aredis.zcard(index) == 0
    outcome = await setup.dispatcher.dispatch(setup.slot, '{"amount": 5}', {})
    assert outcome.error is not None
    assert outcome.error["code"] == "approval_denied"
    assert setup.tool.keys == []


async def test_a_request_never_outlasts_its_turn_s_id(aredis: Redis) -> None:
    setup = Setup(aredis, stream_ttl=60.0, tombstone_ttl=60.0)  # approval_ttl_s: 24 h
    with set_clock(lambda: 1_000.0):
        outcome = await setup.dispatcher.dispatch(setup.slot, '{"amount": 5}', {})
    assert outcome.approval is not None
    assert outcome.approval.expires_ms == 1_000_000 + 120_000
