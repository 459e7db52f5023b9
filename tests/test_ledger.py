"""The tool-call ledger's Lua contract: one claim wins, stale tokens are fenced, outcomes stick."""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

import orjson
import pytest
import redis as redis_lib
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis.asyncio import Redis

from broker.deps import Deps
from broker.keys import Keys
from broker.ledger import Ledger, Slot
from broker.metrics import Metrics
from broker.scripts import Scripts, script_source
from broker.settings import Settings
from tests.conftest import sync_client

_n = itertools.count()
FP = "f" * 64


def ledger_for(aredis: Redis, **overrides: Any) -> tuple[Ledger, Keys]:
    prefix = f"ledger{os.getpid()}-{next(_n)}"
    keys = Keys(prefix)
    config = Settings(redis_url="unix:///unused", key_prefix=prefix, **overrides)
    return Ledger(Deps(aredis, Scripts(aredis), keys, config, Metrics())), keys


def slot(ordinal: int = 0) -> Slot:
    return Slot("conv", "turn", "send_payment", ordinal)


async def expire(aredis: Redis, keys: Keys, target: Slot) -> None:
    """Wait until the slot's lease has run out on the server clock."""
    for _ in range(500):
        until = int(await aredis.hget(target.key(keys), "lease_until") or 0)
        now = await aredis.time()
        if now[0] * 1000 + now[1] // 1000 > until:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("lease did not expire")


async def test_fifty_concurrent_claims_of_one_slot_exactly_one_wins(aredis: Redis) -> None:
    ledger, _ = ledger_for(aredis)
    claims = await asyncio.gather(*(ledger.claim(slot(), FP, {}) for _ in range(50)))
    states = sorted(c.state for c in claims)
    assert states == ["claimed"] + ["in_flight"] * 49


async def test_a_zombie_finish_after_a_takeover_is_fenced(aredis: Redis) -> None:
    ledger, keys = ledger_for(aredis, tool_lease_ms=50)
    first = await ledger.claim(slot(), FP, {})
    await expire(aredis, keys, slot())
    second = await ledger.claim(slot(), FP, {})
    assert second.state == "reclaimed"
    assert int(second.token) > int(first.token)
    assert await ledger.finish(slot(), first.token, "completed", {"paid": "zombie"}) is False
    assert await ledger.finish(slot(), second.token, "completed", {"paid": 1}) is True
    replay = await ledger.claim(slot(), FP, {})
    assert (replay.state, replay.payload) == ("completed", {"paid": 1})


async def test_a_late_finish_with_the_current_token_is_accepted(aredis: Redis) -> None:
    ledger, keys = ledger_for(aredis, tool_lease_ms=50)
    claim = await ledger.claim(slot(), FP, {})
    await expire(aredis, keys, slot())
    assert await ledger.finish(slot(), claim.token, "completed", {"ok": True}) is True
    assert (await ledger.claim(slot(), FP, {})).state == "completed"


async def test_a_heartbeating_holder_is_never_reclaimed(aredis: Redis) -> None:
    ledger, _ = ledger_for(aredis, tool_lease_ms=100)
    claim = await ledger.claim(slot(), FP, {})
    seen = set()
    for _ in range(15):  # 450 ms: four and a half lease periods
        await ledger.renew(slot(), claim.token)
        seen.add((await ledger.claim(slot(), FP, {})).state)
        await asyncio.sleep(0.03)
    assert seen == {"in_flight"}


async def test_failures_are_stored_and_replayed(aredis: Redis) -> None:
    ledger, _ = ledger_for(aredis)
    claim = await ledger.claim(slot(), FP, {})
    error = {"code": "tool_rejected", "message": "card declined"}
    assert await ledger.finish(slot(), claim.token, "failed", error)
    replay = await ledger.claim(slot(), FP, {})
    assert (replay.state, replay.payload) == ("failed", error)
    # A stored outcome never changes.
    assert not await ledger.finish(slot(), claim.token, "completed", {"paid": 1})


async def test_other_arguments_in_the_same_slot_are_a_mismatch(aredis: Redis) -> None:
    ledger, _ = ledger_for(aredis)
    await ledger.claim(slot(), FP, {})
    assert (await ledger.claim(slot(), "0" * 64, {})).state == "args_mismatch"
    assert (await ledger.claim(slot(1), "0" * 64, {})).state == "claimed"  # another ordinal


async def test_script_flush_in_the_middle_changes_nothing(aredis: Redis) -> None:
    ledger, _ = ledger_for(aredis)
    claim = await ledger.claim(slot(), FP, {})
    await aredis.script_flush()
    await ledger.renew(slot(), claim.token)
    assert await ledger.finish(slot(), claim.token, "completed", {"paid": 1})
    await aredis.script_flush()
    assert (await ledger.claim(slot(), FP, {})).payload == {"paid": 1}


def test_idempotency_keys_name_slot_and_arguments() -> None:
    key = slot().idempotency_key(FP)
    assert len(key) == 32
    assert int(key, 16) >= 0
    assert key == slot().idempotency_key(FP)
    assert key != slot(1).idempotency_key(FP)
    assert key != slot().idempotency_key("0" * 64)


# --- random interleavings ------------------------------------------------------------------


class LedgerMachine(RuleBasedStateMachine):
    """Three holders claim, renew, finish and lose leases in any order, against real Redis."""

    redis_url = ""

    def __init__(self) -> None:
        super().__init__()
        self.redis = sync_client(self.redis_url)
        self.scripts = {
            name: self.redis.register_script(script_source(name))
            for name in ("claim_tool", "renew_tool", "finish_tool")
        }
        self.key = f"machine{os.getpid()}-{next(_n)}:{{c:x}}:tool:t:pay:0"
        self.tokens: dict[int, str] = {}
        self.finishes = 0
        self.stored: Any = None

    def teardown(self) -> None:
        self.redis.delete(self.key)
        self.redis.close()

    @rule(holder=st.integers(0, 2))
    def claim(self, holder: int) -> None:
        reply = self.scripts["claim_tool"](
            keys=[self.key, self.key + ":set", self.key + ":lease"],
            args=[FP, 60_000, f"h{holder}", 60_000, "{}", ""],
        )
        if reply[0] in ("claimed", "reclaimed"):
            self.tokens[holder] = reply[1]
        elif reply[0] == "completed":
            assert orjson.loads(reply[1]) == self.stored

    @rule(holder=st.integers(0, 2), value=st.integers(0, 1000))
    def finish(self, holder: int, value: int) -> None:
        token = self.tokens.get(holder, "0")
        reply = self.scripts["finish_tool"](keys=[self.key], args=[token, "completed", value])
        if reply[0] == "ok":
            self.finishes += 1
            self.stored = value

    @rule(holder=st.integers(0, 2))
    def renew(self, holder: int) -> None:
        refused = ""
        try:
            self.scripts["renew_tool"](keys=[self.key], args=[self.tokens.get(holder, "0"), 60_000])
        except redis_lib.ResponseError as exc:
            refused = str(exc)
        assert refused == "" or "FENCED" in refused

    @precondition(lambda self: bool(self.tokens))
    @rule()
    def lease_runs_out(self) -> None:
        # Time passes on the server clock: the current lease is over.
        self.redis.hset(self.key, "lease_until", 0)

    @invariant()
    def at_most_one_finish_and_the_result_never_changes(self) -> None:
        assert self.finishes <= 1
        if self.finishes:
            data = self.redis.hgetall(self.key)
            assert data["state"] == "completed"
            assert orjson.loads(data["result"]) == self.stored


@pytest.fixture
def ledger_machine(redis_url: str) -> type[LedgerMachine]:
    LedgerMachine.redis_url = redis_url
    return LedgerMachine


def test_random_interleavings_keep_the_ledger_sound(ledger_machine: type[LedgerMachine]) -> None:
    run_state_machine_as_test(
        ledger_machine,
        settings=settings(
            max_examples=60,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
