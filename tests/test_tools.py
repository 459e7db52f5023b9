"""Tool calls through the ledger: a re-issued turn never pays twice."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from broker.deps import Deps
from broker.keys import Keys
from broker.ledger import Dispatcher, Ledger, Slot
from broker.metrics import Metrics
from broker.scripts import Scripts
from broker.settings import Settings
from broker.tools import Tool, ToolConfigError, ToolError, ToolRegistry
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import SSEEvent, ToolEndpoint, get_turn, read_sse, start_turn, wait_final

_n = itertools.count()
PAY = {"to": "bob", "amount": 10}
PAYMENT_SCHEMA = {
    "type": "object",
    "required": ["to", "amount"],
    "properties": {"to": {"type": "string"}, "amount": {"type": "number", "exclusiveMinimum": 0}},
}


@pytest.fixture
def tools_file(tmp_path: Path, payments: ToolEndpoint) -> Path:
    path = tmp_path / "tools.json"
    path.write_text(
        json.dumps(
            {
                "tools": [
                    {
                        "name": "send_payment",
                        "class": "unkeyed_write",
                        "schema": PAYMENT_SCHEMA,
                        "endpoint": payments.url,
                        "timeout_s": 5,
                    },
                    {
                        "name": "get_weather",
                        "class": "read",
                        "schema": {"type": "object"},
                        "endpoint": payments.url,
                    },
                ]
            }
        )
    )
    return path


def events_of(broker: RunningBroker, stream_id: str) -> list[SSEEvent]:
    return read_sse(broker.base_url, stream_id).events


def tool_turn(broker: RunningBroker, turn_id: str, **knobs: Any) -> dict[str, Any]:
    return start_turn(broker.base_url, turn_id=turn_id, tokens=8, tokens_per_s=0, **knobs)


# --- end to end ------------------------------------------------------------------------------


def test_a_regenerated_turn_does_not_pay_twice(
    broker_factory: BrokerFactory, tools_file: Path, payments: ToolEndpoint
) -> None:
    broker = broker_factory(tools=str(tools_file))
    script = [{"name": "send_payment", "args": PAY, "after": 2}]
    turn = tool_turn(broker, "pay", tool_calls=script, fail_after_tool_calls=1)
    first = read_sse(broker.base_url, turn["stream_id"])
    # The payment went through, then the stream broke before the message ended.
    assert first.events[-1].data["status"] == "interrupted"
    assert len(payments.requests) == 1
    assert post_attempt(broker, "pay", "regenerate") == 201
    rest = read_sse(broker.base_url, turn["stream_id"], last_event_id=first.events[-1].id)
    assert rest.events[-1].data == {"attempt": 2, "status": "complete", "reason": None}
    assert len(payments.requests) == 1, "the re-emitted call must not reach the endpoint"
    results = [e.data for e in first.events + rest.events if e.event == "tool_result"]
    assert [r["attempt"] for r in results] == [1, 2]
    assert results[0]["result"] == results[1]["result"] == {"payment_id": "pay_1"}
    assert [r["source"] for r in results] == ["ran", "replayed"]
    assert re.fullmatch(r"[0-9a-f]{32}", payments.requests[0]["key"])
    assert payments.requests[0]["body"] == {"name": "send_payment", "arguments": PAY}
    audit = httpx.get(f"{broker.base_url}/v1/turns/pay/tool-calls", timeout=5).json()
    (row,) = audit["tool_calls"]
    assert (row["tool"], row["ordinal"], row["state"], row["claims"]) == (
        "send_payment",
        0,
        "completed",
        1,
    )
    assert row["result"] == {"payment_id": "pay_1"}
    assert row["idempotency_key"] == payments.requests[0]["key"]
    assert (
        broker.metric("broker_tool_calls_total", '{outcome="replayed",tool_class="unkeyed_write"}')
        == 1
    )


def post_attempt(broker: RunningBroker, turn_id: str, strategy: str) -> int:
    return httpx.post(
        f"{broker.base_url}/v1/turns/{turn_id}/attempts", json={"strategy": strategy}, timeout=5
    ).status_code


def test_the_agent_loop_continues_with_the_tool_result(
    broker_factory: BrokerFactory, tools_file: Path, payments: ToolEndpoint
) -> None:
    broker = broker_factory(tools=str(tools_file))
    script = [{"name": "get_weather", "args": {"city": "Oslo"}, "after": 3}]
    turn = tool_turn(broker, "loop", tool_calls=script, seed=5)
    events = events_of(broker, turn["stream_id"])
    kinds = [e.event for e in events]
    assert kinds.index("tool_call") < kinds.index("tool_result")
    assert kinds.count("delta") == 8  # 3 before the call, 5 after its result came back
    assert events[-1].data["status"] == "complete"
    call = events[kinds.index("tool_call")].data
    assert (call["name"], call["args"], call["ordinal"]) == ("get_weather", {"city": "Oslo"}, 0)
    plain = tool_turn(broker, "plain", seed=5)
    assert get_turn(broker.base_url, "loop")["canonical"]["text"] == "".join(
        e.data["text"] for e in events_of(broker, plain["stream_id"]) if e.event == "delta"
    )


def test_two_identical_calls_in_one_turn_are_two_ordinals_and_both_run(
    broker_factory: BrokerFactory, tools_file: Path, payments: ToolEndpoint
) -> None:
    broker = broker_factory(tools=str(tools_file))
    script = [
        {"name": "send_payment", "args": PAY, "after": 1},
        {"name": "send_payment", "args": PAY, "after": 2},
    ]
    turn = tool_turn(broker, "twice", tool_calls=script)
    events = events_of(broker, turn["stream_id"])
    assert events[-1].data["status"] == "complete"
    assert len(payments.requests) == 2
    assert payments.requests[0]["key"] != payments.requests[1]["key"]
    assert [e.data["ordinal"] for e in events if e.event == "tool_call"] == [0, 1]


def test_a_call_cut_while_its_arguments_arrive_is_not_run(
    broker_factory: BrokerFactory, tools_file: Path, payments: ToolEndpoint
) -> None:
    broker = broker_factory(tools=str(tools_file))
    script = [{"name": "send_payment", "args": PAY, "after": 2}]
    turn = tool_turn(broker, "cut", tool_calls=script, cut_during_tool_args=True)
    events = events_of(broker, turn["stream_id"])
    assert events[-1].data["status"] == "interrupted"
    assert payments.requests == []
    assert "tool_result" not in [e.event for e in events]
    (call,) = [e.data for e in events if e.event == "tool_call"]
    assert (call["status"], call["reason"]) == ("not_run", "connection_lost")
    audit = httpx.get(f"{broker.base_url}/v1/turns/cut/tool-calls", timeout=5).json()
    assert [(r["state"], r["reason"]) for r in audit["tool_calls"]] == [
        ("not_run", "connection_lost")
    ]
    assert post_attempt(broker, "cut", "regenerate") == 201
    assert wait_final(broker.base_url, "cut")["status"] == "complete"
    assert len(payments.requests) == 1  # the call runs once, when it is whole


def test_invalid_arguments_are_refused_to_the_model_not_sent(
    broker_factory: BrokerFactory, tools_file: Path, payments: ToolEndpoint
) -> None:
    broker = broker_factory(tools=str(tools_file))
    script = [
        {"name": "send_payment", "args": {"to": "bob", "amount": -5}, "after": 1},
        {"name": "launch_rockets", "args": {}, "after": 1},
    ]
    turn = tool_turn(broker, "bad-args", tool_calls=script)
    events = events_of(broker, turn["stream_id"])
    errors = [e.data["error"]["code"] for e in events if e.event == "tool_result"]
    assert errors == ["invalid_arguments", "unknown_tool"]
    assert payments.requests == []
    assert events[-1].data["status"] == "complete"


def test_script_flush_during_a_turn_changes_nothing(broker: RunningBroker, raw_redis: Any) -> None:
    turn = start_turn(broker.base_url, turn_id="flush", seed=3, tokens=30, tokens_per_s=100)
    read_sse(broker.base_url, turn["stream_id"], stop_after=5)
    raw_redis.script_flush()
    events = events_of(broker, turn["stream_id"])
    assert events[-1].data["status"] == "complete"
    reference = start_turn(broker.base_url, turn_id="noflush", seed=3, tokens=30, tokens_per_s=0)
    assert [e.data.get("text") for e in events if e.event == "delta"] == [
        e.data.get("text") for e in events_of(broker, reference["stream_id"]) if e.event == "delta"
    ]


# --- the dispatcher, class by class ------------------------------------------------------------


class Recorder:
    """A Python tool that records its calls."""

    def __init__(self, fail: ToolError | None = None) -> None:
        self.keys: list[str] = []
        self.fail = fail

    async def __call__(self, arguments: dict[str, Any], key: str) -> Any:
        self.keys.append(key)
        if self.fail is not None:
            raise self.fail
        return {"n": len(self.keys)}


def dispatcher_for(aredis: Redis, tools: list[Tool], **overrides: Any) -> Dispatcher:
    prefix = f"dispatch{os.getpid()}-{next(_n)}"
    config = Settings(redis_url="unix:///unused", key_prefix=prefix, **overrides)
    ledger = Ledger(Deps(aredis, Scripts(aredis), Keys(prefix), config, Metrics()))
    return Dispatcher(ToolRegistry(tools), ledger, httpx.AsyncClient(), config, Metrics())


async def abandoned_claim(dispatcher: Dispatcher, target: Slot, arguments: dict[str, Any]) -> None:
    """A holder that claimed the slot and died: its lease runs out, nothing is stored."""
    from broker.canonical import fingerprint

    await dispatcher.ledger.claim(target, fingerprint(arguments), {})
    await asyncio.sleep(0.08)  # > tool_lease_ms below: the dead holder's lease is over


@pytest.mark.parametrize(
    ("kind", "runs", "fail_reason"),
    [("read", 1, None), ("keyed_write", 1, None), ("unkeyed_write", 0, "unknown_outcome")],
)
async def test_after_a_lease_expiry_each_class_does_what_it_promises(
    aredis: Redis, kind: str, runs: int, fail_reason: str | None
) -> None:
    recorder = Recorder()
    tool = Tool(name="t", kind=kind, schema={"type": "object"}, function=recorder)  # type: ignore[arg-type]
    dispatcher = dispatcher_for(aredis, [tool], tool_lease_ms=50)
    target = Slot("c", "turn", "t", 0)
    await abandoned_claim(dispatcher, target, {"x": 1})
    outcome = await dispatcher.dispatch(target, '{"x": 1}', {})
    assert len(recorder.keys) == runs
    assert outcome.fail_reason == fail_reason
    if kind == "keyed_write":
        assert recorder.keys == [target.idempotency_key(outcome_fp({"x": 1}))]
    again = await dispatcher.dispatch(target, '{"x": 1}', {})
    assert again.source == "replayed"
    assert again.fail_reason == fail_reason  # an unknown outcome stays unknown, never re-sent
    assert len(recorder.keys) == runs


def outcome_fp(arguments: dict[str, Any]) -> str:
    from broker.canonical import fingerprint

    return fingerprint(arguments)


async def test_a_call_in_flight_elsewhere_is_waited_for_then_fails_the_turn(
    aredis: Redis,
) -> None:
    tool = Tool(name="t", kind="unkeyed_write", schema={"type": "object"}, function=Recorder())
    dispatcher = dispatcher_for(aredis, [tool], tool_in_flight_wait_s=0.2)
    target = Slot("c", "turn", "t", 0)
    claim = await dispatcher.ledger.claim(target, outcome_fp({}), {})
    outcome = await dispatcher.dispatch(target, "{}", {})
    assert outcome.fail_reason == "in_flight_timeout"
    await dispatcher.ledger.finish(target, claim.token, "completed", {"done": True})
    assert (await dispatcher.dispatch(target, "{}", {})).result == {"done": True}


async def test_other_arguments_fail_a_write_but_run_a_read(aredis: Redis) -> None:
    write = Tool(name="w", kind="keyed_write", schema={"type": "object"}, function=Recorder())
    reader = Recorder()
    read = Tool(name="r", kind="read", schema={"type": "object"}, function=reader)
    dispatcher = dispatcher_for(aredis, [write, read])
    for name in ("w", "r"):
        assert (await dispatcher.dispatch(Slot("c", "t", name, 0), '{"a": 1}', {})).source == "ran"
    mismatch = await dispatcher.dispatch(Slot("c", "t", "w", 0), '{"a": 2}', {})
    assert mismatch.fail_reason == "args_mismatch"
    rerun = await dispatcher.dispatch(Slot("c", "t", "r", 0), '{"a": 2}', {})
    assert (rerun.source, rerun.fail_reason) == ("ran", None)
    assert len(reader.keys) == 2


async def test_an_unknown_outcome_of_an_unkeyed_write_fails_and_is_stored(aredis: Redis) -> None:
    flaky = Recorder(fail=ToolError("tool_timeout", "no answer", outcome_known=False))
    tool = Tool(name="pay", kind="unkeyed_write", schema={"type": "object"}, function=flaky)
    dispatcher = dispatcher_for(aredis, [tool])
    outcome = await dispatcher.dispatch(Slot("c", "t", "pay", 0), "{}", {})
    assert outcome.fail_reason == "unknown_outcome"
    replay = await dispatcher.dispatch(Slot("c", "t", "pay", 0), "{}", {})
    assert (replay.source, replay.fail_reason) == ("replayed", "unknown_outcome")
    assert len(flaky.keys) == 1


# --- the registry ------------------------------------------------------------------------------


def test_the_audit_names_every_tool_and_its_protection(tools_file: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "broker", "tools", "audit", "--file", str(tools_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["tool", "class"]
    payment = next(line for line in lines if line.startswith("send_payment"))
    assert "unkeyed_write" in payment
    assert "yes" in payment
    assert "never re-sent" in payment
    weather = next(line for line in lines if line.startswith("get_weather"))
    assert "harmless" in weather


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"tools": [{"name": "x", "class": "maybe_write", "endpoint": "http://a"}]}', "class"),
        ('{"tools": [{"name": "x", "class": "read"}]}', "exactly one of endpoint or function"),
        ('{"tools": [{"name": "bad name", "class": "read", "endpoint": "http://a"}]}', "name"),
        ('{"tools": [{"class": "read", "endpoint": "http://a"}]}', "lacks 'name'"),
        (
            '{"tools": [{"name": "x", "class": "read", "endpoint": "http://a", '
            '"schema": {"type": 5}}]}',
            "invalid schema",
        ),
        ("not json", "cannot read"),
    ],
)
def test_bad_tool_files_are_refused_clearly(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "tools.json"
    path.write_text(content)
    with pytest.raises(ToolConfigError, match=message):
        ToolRegistry.from_file(path)


def test_a_toml_tools_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "tools.toml"
    path.write_text('[[tools]]\nname = "lookup"\nclass = "read"\nendpoint = "http://x/y"\n')
    registry = ToolRegistry.from_file(path)
    tool = registry.get("lookup")
    assert tool is not None
    assert tool.kind == "read"


# --- regressions from review ----------------------------------------------------------------


class Slow:
    """A Python tool that takes ``seconds`` (or hangs) before it answers."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls = 0
        self.started = asyncio.Event()

    async def __call__(self, arguments: dict[str, Any], key: str) -> Any:
        self.calls += 1
        self.started.set()
        await asyncio.sleep(self.seconds)
        return {"done": self.calls}


async def test_a_renewal_blip_does_not_lose_the_outcome(
    aredis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis as redis_lib

    original = Ledger.renew
    blips = 0

    async def flaky(self: Ledger, slot: Slot, token: str, lease_ms: int | None = None) -> None:
        nonlocal blips
        if blips == 0:
            blips += 1
            raise redis_lib.exceptions.ConnectionError("blip")
        await original(self, slot, token, lease_ms)

    monkeypatch.setattr(Ledger, "renew", flaky)
    tool = Tool(name="pay", kind="unkeyed_write", schema={"type": "object"}, function=Slow(0.2))
    dispatcher = dispatcher_for(aredis, [tool], tool_lease_ms=60)
    outcome = await dispatcher.dispatch(Slot("c", "t", "pay", 0), "{}", {})
    assert blips == 1
    assert outcome.result == {"done": 1}
    assert (await dispatcher.dispatch(Slot("c", "t", "pay", 0), "{}", {})).source == "replayed"


@pytest.mark.parametrize(("kind", "after"), [("unkeyed_write", "failed"), ("read", "reclaimed")])
async def test_a_call_stopped_midway_is_recorded_not_left_in_flight(
    aredis: Redis, kind: str, after: str
) -> None:
    slow = Slow(30)
    tool = Tool(name="t", kind=kind, schema={"type": "object"}, function=slow)  # type: ignore[arg-type]
    dispatcher = dispatcher_for(aredis, [tool])
    target = Slot("c", "t", "t", 0)
    task = asyncio.create_task(dispatcher.dispatch(target, "{}", {}))
    await asyncio.wait_for(slow.started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    claim = await dispatcher.ledger.claim(target, outcome_fp({}), {})
    assert claim.state == after
    if after == "failed":
        assert claim.payload["code"] == "unknown_outcome"


async def test_a_hanging_or_raising_callable_write_has_an_unknown_outcome(aredis: Redis) -> None:
    hang = Tool(
        name="hang",
        kind="unkeyed_write",
        schema={"type": "object"},
        function=Slow(30),
        timeout_s=0.1,
    )

    async def raises(arguments: dict[str, Any], key: str) -> Any:
        raise RuntimeError("socket closed after the charge")

    boom = Tool(name="boom", kind="unkeyed_write", schema={"type": "object"}, function=raises)
    dispatcher = dispatcher_for(aredis, [hang, boom])
    for name in ("hang", "boom"):
        outcome = await dispatcher.dispatch(Slot("c", "t", name, 0), "{}", {})
        assert outcome.fail_reason == "unknown_outcome", name


async def test_every_claim_restarts_the_slot_retention(aredis: Redis) -> None:
    dispatcher = dispatcher_for(aredis, [])
    ledger = dispatcher.ledger
    target = Slot("c", "t", "pay", 0)
    claim = await ledger.claim(target, outcome_fp({}), {})
    await ledger.finish(target, claim.token, "completed", {"ok": 1})
    key = target.key(ledger._keys)
    await aredis.pexpire(key, 1000)
    await ledger.claim(target, outcome_fp({}), {})  # a replay, e.g. by a regenerate
    assert await aredis.pttl(key) > 10_000


async def test_a_worker_that_lost_its_turn_cannot_claim_tool_calls(aredis: Redis) -> None:
    from broker.errors import FencedWrite

    dispatcher = dispatcher_for(aredis, [])
    ledger = dispatcher.ledger
    target = Slot("c", "t", "pay", 0)
    await aredis.hset(ledger._keys.lease("c", "t"), mapping={"token": "7", "owner": "b"})
    with pytest.raises(FencedWrite):
        await ledger.claim(target, outcome_fp({}), {}, lease_token="6")
    assert (await ledger.claim(target, outcome_fp({}), {}, lease_token="7")).state == "claimed"


def test_stop_messages_name_their_attempt() -> None:
    from broker.vocabulary import decode_attempt_ref

    assert decode_attempt_ref("conv turn-1 3") == ("conv", "turn-1", 3)
    assert decode_attempt_ref("garbage") == ("", "", 0)
