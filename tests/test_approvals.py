"""Tool approvals: a call that writes waits for a person, and runs once, whoever decides."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from broker.approval_rules import set_clock
from broker_client import ApprovalDecision, ApprovalRequest, BrokerClient
from tests.approval_fixtures import BIG, SMALL, tools_file
from tests.conftest import BrokerFactory, BrokerProcess, RunningBroker
from tests.helpers import (
    SSEEvent,
    ToolEndpoint,
    get_turn,
    read_sse,
    start_turn,
    text_of,
    wait_final,
    wait_until,
)


def pay_turn(broker: RunningBroker, turn_id: str, args: dict[str, Any] = BIG, **knobs: Any) -> Any:
    script = [{"name": "send_payment", "args": args, "after": 3}]
    return start_turn(
        broker.base_url,
        turn_id=turn_id,
        tokens=8,
        tokens_per_s=0,
        tool_calls=script,
        **knobs,
    )


def wait_awaiting(broker: RunningBroker, turn_id: str, auth: str | None = None) -> dict[str, Any]:
    turn: dict[str, Any] = wait_until(
        lambda: (
            (t := get_turn(broker.base_url, turn_id, auth))["status"] == "awaiting_approval" and t
        )
    )
    return turn


def decide(
    broker: RunningBroker, turn_id: str, approval_id: str, decision: str, **extra: Any
) -> httpx.Response:
    return httpx.post(
        f"{broker.base_url}/v1/turns/{turn_id}/approvals/{approval_id}",
        json={"decision": decision, **extra},
        timeout=10,
    )


def kinds(events: list[SSEEvent]) -> list[str]:
    return [e.event for e in events]


def test_a_small_payment_runs_without_asking(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    turn = pay_turn(approved_broker, "small", SMALL)
    events = read_sse(approved_broker.base_url, turn["stream_id"]).events
    assert "approval_request" not in kinds(events)
    assert events[-1].data["status"] == "complete"
    assert len(payments.requests) == 1


def test_two_tabs_see_the_request_a_third_client_approves_the_tool_runs_once(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    turn = pay_turn(broker, "big")
    reads: list[list[SSEEvent]] = [[], []]

    def tab(i: int) -> None:
        reads[i] = read_sse(broker.base_url, turn["stream_id"]).events

    tabs = [threading.Thread(target=tab, args=(i,)) for i in range(2)]
    for thread in tabs:
        thread.start()
    state = wait_awaiting(broker, "big")
    (pending,) = state["approvals"]
    assert pending["name"] == "send_payment"
    assert pending["args"] == BIG
    assert state["attempts"][-1]["status"] == "awaiting_approval"
    assert payments.requests == []
    response = decide(broker, "big", pending["approval_id"], "approve")
    assert response.status_code == 200, response.text
    assert response.json()["decision"] == "approve"
    assert response.json()["by"] == "person"
    for thread in tabs:
        thread.join(timeout=20)
        assert not thread.is_alive()
    assert len(payments.requests) == 1
    for events in reads:
        order = kinds(events)
        assert order.index("approval_request") < order.index("approval_decision")
        assert order.index("approval_decision") < order.index("tool_result")
        request = next(e for e in events if e.event == "approval_request")
        assert request.data["approval_id"] == pending["approval_id"]
        result = next(e for e in events if e.event == "tool_result")
        assert result.data["source"] == "ran"
        assert result.data["result"] == {"payment_id": "pay_1"}
        assert events[-1].data["status"] == "complete"
        assert order.count("attempt") == 1, "the attempt goes on: no new one"
    assert (
        text_of(reads[0])
        == text_of(reads[1])
        == wait_final(broker.base_url, "big")["canonical"]["text"]
    )
    # The same decision again stands (200); another is a 409 naming the one that stands.
    again = decide(broker, "big", pending["approval_id"], "approve")
    assert again.status_code == 200
    assert again.json()["decision"] == "approve"
    other = decide(broker, "big", pending["approval_id"], "deny")
    assert other.status_code == 409
    assert other.json()["decision"] == "approve"
    assert other.json()["error"]["code"] == "approval_decided"
    assert broker.metric("broker_approvals_requested_total") == 1
    assert broker.metric("broker_approvals_decided_total", '{by="person",decision="approve"}') == 1


def test_a_reader_that_reattaches_sees_the_request_again(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    turn = pay_turn(broker, "reload")
    wait_awaiting(broker, "reload")
    first = read_sse(broker.base_url, turn["stream_id"], stop_after=1)
    assert first.events[0].event == "attempt"
    again = httpx.get(
        f"{broker.base_url}/v1/streams/{turn['stream_id']}", params={"format": "json"}, timeout=5
    ).json()
    assert "approval_request" in [e["event"] for e in again["events"]]
    assert again["closed"] is False


def test_deny_tells_the_model_and_it_goes_on_without_the_payment(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    turn = pay_turn(broker, "deny")
    (pending,) = wait_awaiting(broker, "deny")["approvals"]
    response = decide(broker, "deny", pending["approval_id"], "deny", reason="too much")
    assert response.status_code == 200
    assert response.json()["reason"] == "too much"
    final = wait_final(broker.base_url, "deny")
    assert final["status"] == "complete"
    events = read_sse(broker.base_url, turn["stream_id"]).events
    result = next(e for e in events if e.event == "tool_result")
    assert result.data["status"] == "error"
    assert result.data["source"] == "replayed"
    assert result.data["error"]["code"] == "approval_denied"
    assert "too much" in result.data["error"]["message"]
    assert payments.requests == []
    # A regenerate meets the same slot: still denied, never run, never asked again.
    assert post_attempt(broker, "deny") == 201
    final = wait_final(broker.base_url, "deny")
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert kinds(events).count("approval_request") == 1
    results = [e.data for e in events if e.event == "tool_result"]
    assert [r["error"]["code"] for r in results] == ["approval_denied"] * 2
    assert payments.requests == []


def test_a_regenerate_after_approval_replays_the_payment(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    turn = pay_turn(broker, "regen")
    (pending,) = wait_awaiting(broker, "regen")["approvals"]
    assert decide(broker, "regen", pending["approval_id"], "approve").status_code == 200
    wait_final(broker.base_url, "regen")
    assert post_attempt(broker, "regen") == 201
    assert wait_final(broker.base_url, "regen")["status"] == "complete"
    events = read_sse(broker.base_url, turn["stream_id"]).events
    results = [e.data for e in events if e.event == "tool_result"]
    assert [r["source"] for r in results] == ["ran", "replayed"]
    assert kinds(events).count("approval_request") == 1
    assert len(payments.requests) == 1


def test_a_regenerate_meets_the_same_pending_approval(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    # The upstream breaks right after the call: the attempt ends interrupted, still pending.
    turn = pay_turn(broker, "again", fail_after_tool_calls=1)
    final = wait_final(broker.base_url, "again")
    assert final["status"] == "interrupted"
    first = read_sse(broker.base_url, turn["stream_id"]).events
    (request,) = [e.data for e in first if e.event == "approval_request"]
    assert post_attempt(broker, "again") == 201
    (pending,) = wait_awaiting(broker, "again")["approvals"]
    assert pending["approval_id"] == request["approval_id"]
    assert decide(broker, "again", pending["approval_id"], "approve").status_code == 200
    assert wait_final(broker.base_url, "again")["status"] == "complete"
    assert len(payments.requests) == 1


def test_stop_while_waiting_cancels_the_turn_and_its_approval(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    turn = pay_turn(broker, "stop")
    (pending,) = wait_awaiting(broker, "stop")["approvals"]
    stopped = httpx.post(f"{broker.base_url}/v1/turns/stop/cancel", timeout=10).json()
    assert stopped["status"] == "cancelled"
    events = read_sse(broker.base_url, turn["stream_id"]).events
    decision = next(e for e in events if e.event == "approval_decision")
    assert (decision.data["decision"], decision.data["by"]) == ("deny", "stop")
    assert events[-1].event == "end"
    assert events[-1].data["status"] == "cancelled"
    late = decide(broker, "stop", pending["approval_id"], "approve")
    assert late.status_code == 409
    assert late.json()["by"] == "stop"
    assert payments.requests == []
    assert broker.metric("broker_approvals_decided_total", '{by="stop",decision="deny"}') == 1


def test_an_expired_approval_is_denied_by_the_sweep(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    turn = pay_turn(broker, "late")
    (pending,) = wait_awaiting(broker, "late")["approvals"]
    assert pending["expires_at"] > 0
    with set_clock(lambda: pending["expires_at"] + 1):
        assert broker.call(broker.runtime.turns.approvals.sweep()) == 1
    final = wait_final(broker.base_url, "late")
    assert final["status"] == "complete"
    events = read_sse(broker.base_url, turn["stream_id"]).events
    decision = next(e for e in events if e.event == "approval_decision")
    assert decision.data == {
        "attempt": 1,
        "approval_id": pending["approval_id"],
        "decision": "deny",
        "reason": "expired",
        "by": "expiry",
    }
    assert payments.requests == []


def test_a_decision_after_the_expiry_is_the_expiry_s(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    pay_turn(broker, "too-late")
    (pending,) = wait_awaiting(broker, "too-late")["approvals"]
    with set_clock(lambda: pending["expires_at"] + 1):
        late = decide(broker, "too-late", pending["approval_id"], "approve")
    assert late.status_code == 409
    assert (late.json()["decision"], late.json()["reason"]) == ("deny", "expired")
    assert wait_final(broker.base_url, "too-late")["status"] == "complete"
    assert payments.requests == []


def test_a_tool_s_own_ttl_overrides_the_default(
    broker_factory: BrokerFactory, tmp_path: Path, payments: ToolEndpoint
) -> None:
    broker = broker_factory(
        tools=str(tools_file(tmp_path, payments.url, approval_ttl_s=60)), approval_ttl_s=3600
    )
    pay_turn(broker, "ttl")
    wait_awaiting(broker, "ttl")
    request_event = next(
        e
        for e in httpx.get(
            f"{broker.base_url}/v1/streams/{get_turn(broker.base_url, 'ttl')['stream_id']}",
            params={"format": "json"},
            timeout=5,
        ).json()["events"]
        if e["event"] == "approval_request"
    )
    created_s = get_turn(broker.base_url, "ttl")["created_ms"] / 1000
    assert 55 < request_event["data"]["expires_at"] - created_s < 65


def test_approving_from_two_clients_at_once_decides_once_and_pays_once(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    rounds = 100  # as many as the issue asks: one decision and one payment in each

    async def race(i: int, client: httpx.AsyncClient) -> None:
        turn_id = f"race-{i}"
        await asyncio.to_thread(pay_turn, broker, turn_id)
        state = await asyncio.to_thread(wait_awaiting, broker, turn_id)
        approval_id = state["approvals"][0]["approval_id"]
        url = f"/v1/turns/{turn_id}/approvals/{approval_id}"
        answers = await asyncio.gather(
            client.post(url, json={"decision": "approve"}),
            client.post(url, json={"decision": "approve"}),
        )
        assert [a.status_code for a in answers] == [200, 200]
        assert {a.json()["decision"] for a in answers} == {"approve"}

    async def main() -> None:
        # Ten races at a time (each its own turn); each race's two answers go at once.
        slots = asyncio.Semaphore(10)

        async def one(i: int, client: httpx.AsyncClient) -> None:
            async with slots:
                await race(i, client)

        async with httpx.AsyncClient(base_url=broker.base_url, timeout=20) as client:
            await asyncio.gather(*(one(i, client) for i in range(rounds)))

    asyncio.run(main())
    for i in range(rounds):
        assert wait_final(broker.base_url, f"race-{i}")["status"] == "complete"
    assert len(payments.requests) == rounds
    assert len({r["key"] for r in payments.requests}) == rounds
    assert (
        broker.metric("broker_approvals_decided_total", '{by="person",decision="approve"}')
        == rounds
    )


def test_deciding_needs_a_known_approval_and_a_valid_body(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    pay_turn(broker, "bad")
    (pending,) = wait_awaiting(broker, "bad")["approvals"]
    assert decide(broker, "bad", "apr_" + "0" * 24, "approve").status_code == 404
    assert decide(broker, "bad", "nope", "approve").status_code == 404
    bad = decide(broker, "bad", pending["approval_id"], "maybe")
    assert bad.status_code == 400
    assert "decision" in bad.text
    extra = decide(broker, "bad", pending["approval_id"], "approve", note="x")
    assert extra.status_code == 400
    assert "note" in extra.text
    assert get_turn(broker.base_url, "bad")["status"] == "awaiting_approval"


def post_attempt(broker: RunningBroker, turn_id: str) -> int:
    return httpx.post(
        f"{broker.base_url}/v1/turns/{turn_id}/attempts",
        json={"strategy": "regenerate"},
        timeout=5,
    ).status_code


def test_a_broker_killed_while_an_approval_waits_loses_nothing(
    broker_processes: Callable[[dict[str, str]], BrokerProcess],
    redis_url: str,
    tmp_path: Path,
    payments: ToolEndpoint,
) -> None:
    env = {
        "BROKER_REDIS_URL": redis_url,
        "BROKER_KEY_PREFIX": f"apv-kill{os.getpid()}",
        "BROKER_TOOLS": str(tools_file(tmp_path, payments.url)),
        "BROKER_SIMULATE_SCRIPTING": "on",
    }
    first = broker_processes(env)
    script = [{"name": "send_payment", "args": BIG, "after": 3}]
    turn = start_turn(first.base_url, turn_id="kill", tokens=8, tokens_per_s=0, tool_calls=script)
    state = wait_until(
        lambda: (t := get_turn(first.base_url, "kill"))["status"] == "awaiting_approval" and t
    )
    first.stop(signal.SIGKILL)
    second = broker_processes(env)
    (pending,) = get_turn(second.base_url, "kill")["approvals"]
    assert pending == state["approvals"][0]
    answer = httpx.post(
        f"{second.base_url}/v1/turns/kill/approvals/{pending['approval_id']}",
        json={"decision": "approve"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    assert wait_final(second.base_url, "kill", timeout=20)["status"] == "complete"
    events = read_sse(second.base_url, turn["stream_id"]).events
    assert [e.data["source"] for e in events if e.event == "tool_result"] == ["ran"]
    assert len(payments.requests) == 1


def test_an_attach_token_with_the_approve_scope_decides_its_own_turn_only(
    broker_factory: BrokerFactory, tmp_path: Path, payments: ToolEndpoint
) -> None:
    key = "key-approvals-0123456789"
    broker = broker_factory(
        tools=str(tools_file(tmp_path, payments.url)),
        api_keys=f"shop={key}",
        simulate_scripting="on",
    )
    auth = {"Authorization": f"Bearer {key}"}
    script = [{"name": "send_payment", "args": BIG, "after": 3}]
    for turn_id in ("mine", "other"):
        start_turn(
            broker.base_url, turn_id=turn_id, tokens=8, tokens_per_s=0, tool_calls=script, auth=key
        )
    pending: dict[str, str] = {}
    for turn_id in ("mine", "other"):
        state = wait_awaiting(broker, turn_id, key)
        pending[turn_id] = state["approvals"][0]["approval_id"]

    def mint(**body: Any) -> str:
        url = f"{broker.base_url}/v1/turns/mine/attach-tokens"
        response = httpx.post(url, json=body, headers=auth, timeout=5)
        assert response.status_code == 201, response.text
        token: str = response.json()["token"]
        return token

    def decide_with(token: str, turn_id: str) -> httpx.Response:
        return httpx.post(
            f"{broker.base_url}/v1/turns/{turn_id}/approvals/{pending[turn_id]}",
            json={"decision": "approve"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )

    read_only = decide_with(mint(), "mine")
    assert read_only.status_code == 403
    assert read_only.json()["error"]["code"] == "read_only"
    approver = mint(approve=True)
    assert decide_with(approver, "other").status_code == 403
    assert decide_with(approver, "mine").status_code == 200
    assert wait_final(broker.base_url, "mine", auth=key)["status"] == "complete"
    assert get_turn(broker.base_url, "other", key)["status"] == "awaiting_approval"
    assert len(payments.requests) == 1


async def test_the_python_client_sees_the_request_and_approves_it(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    turn = await asyncio.to_thread(pay_turn, broker, "client")
    async with BrokerClient(broker.base_url) as client:
        requests: list[ApprovalRequest] = []
        decisions: list[ApprovalDecision] = []
        async for event in client.attach(turn["stream_id"]):
            if event.type == "approval_request":
                request = ApprovalRequest.from_data(event.data)
                requests.append(request)
                state = await client.get_turn("client")
                assert [a["approval_id"] for a in state["approvals"]] == [request.approval_id]
                decided = await client.approve("client", request.approval_id)
                assert (decided.decision, decided.by) == ("approve", "person")
                # Another device's late deny gets the decision that stands.
                late = await client.deny("client", request.approval_id, "no")
                assert late == decided
            elif event.type == "approval_decision":
                decisions.append(ApprovalDecision.from_data(event.data))
    assert [d.approval_id for d in decisions] == [r.approval_id for r in requests]
    assert requests[0].args == BIG
    assert len(payments.requests) == 1


def test_two_calls_in_one_message_wait_for_both_decisions(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    script = [
        {"name": "send_payment", "args": BIG, "after": 3},
        {"name": "send_payment", "args": {"to": "carol", "amount": 700}, "after": 3},
    ]
    turn = start_turn(broker.base_url, turn_id="both", tokens=8, tokens_per_s=0, tool_calls=script)
    first, second = wait_awaiting(broker, "both")["approvals"]
    assert (first["ordinal"], second["ordinal"]) == (0, 1)
    # A new attempt may not start while the turn waits.
    assert post_attempt(broker, "both") == 409
    assert decide(broker, "both", first["approval_id"], "approve").status_code == 200
    still = get_turn(broker.base_url, "both")
    assert still["status"] == "awaiting_approval"
    assert [a["approval_id"] for a in still["approvals"]] == [second["approval_id"]]
    assert decide(broker, "both", second["approval_id"], "deny").status_code == 200
    assert wait_final(broker.base_url, "both")["status"] == "complete"
    events = read_sse(broker.base_url, turn["stream_id"]).events
    results = {e.data["ordinal"]: e.data for e in events if e.event == "tool_result"}
    assert results[0]["source"] == "ran"
    assert results[1]["error"]["code"] == "approval_denied"
    assert [r["body"]["arguments"]["to"] for r in payments.requests] == ["bob"]


def test_a_regenerate_after_a_stop_asks_again(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    pay_turn(broker, "ask-again")
    (first,) = wait_awaiting(broker, "ask-again")["approvals"]
    httpx.post(f"{broker.base_url}/v1/turns/ask-again/cancel", timeout=10)
    assert wait_final(broker.base_url, "ask-again")["status"] == "cancelled"
    assert post_attempt(broker, "ask-again") == 201
    (second,) = wait_awaiting(broker, "ask-again")["approvals"]
    assert second["approval_id"] != first["approval_id"], "the stop freed the slot"
    assert decide(broker, "ask-again", second["approval_id"], "approve").status_code == 200
    assert wait_final(broker.base_url, "ask-again")["status"] == "complete"
    assert len(payments.requests) == 1


def test_a_responses_client_sees_the_request_and_the_continuation_after_the_native_decision(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    """The OpenAI Responses door shows the pending approval as an ``mcp_approval_request``
    item (see tests/test_openai_approvals.py); a decision made through the native route is
    the same decision: the continuation ``<response id>:<approval id>`` holds the answer."""
    broker = approved_broker
    sdk = openai.OpenAI(base_url=f"{broker.base_url}/v1", api_key="unused", max_retries=0)
    script = [{"name": "send_payment", "args": BIG, "after": 3}]
    simulate = {"tokens": 8, "tokens_per_s": 0, "tool_calls": script}
    response = sdk.responses.create(
        model="simulated",
        input="pay bob",
        background=True,
        extra_body={"broker": {"params": {"simulate": simulate}}},
    )
    (pending,) = wait_awaiting(broker, response.id)["approvals"]
    shown = sdk.responses.retrieve(response.id)
    assert shown.status == "completed"
    assert [item.id for item in shown.output if item.type == "mcp_approval_request"] == [
        pending["approval_id"]
    ]
    assert decide(broker, response.id, pending["approval_id"], "approve").status_code == 200
    final = wait_final(broker.base_url, response.id)
    continued = sdk.responses.retrieve(f"{response.id}:{pending['approval_id']}")
    assert continued.status == "completed"
    assert shown.output_text + continued.output_text == final["canonical"]["text"]
    assert len(payments.requests) == 1


def test_a_resumed_approval_waits_for_a_stream_slot_of_its_tenant(
    broker_factory: BrokerFactory, tmp_path: Path, payments: ToolEndpoint
) -> None:
    """Regression: a parked turn gives its tenant's stream slot back, and its resume was queued
    without taking one again, so a tenant at BROKER_MAX_STREAMS_PER_TENANT ran one more."""
    broker = broker_factory(tools=str(tools_file(tmp_path, payments.url)), max_streams_per_tenant=1)
    runtime = broker.runtime
    live = runtime.keys.live_streams(None)
    pay_turn(broker, "parked")
    (pending,) = wait_awaiting(broker, "parked")["approvals"]
    # Its slot is free while it waits: another turn takes it, and the tenant is at its cap.
    start_turn(broker.base_url, turn_id="busy", tokens=500, tokens_per_s=20, expect=201)
    wait_until(lambda: get_turn(broker.base_url, "busy")["status"] == "streaming")
    assert decide(broker, "parked", pending["approval_id"], "approve").status_code == 200
    # The approved turn is not failed: it waits, queued, through a few reclaim passes (each
    # would resume it without its slot), and the cap holds all along.
    passes = 3 * runtime.settings.reclaim_every_s
    deadline = time.monotonic() + passes
    while time.monotonic() < deadline:
        assert get_turn(broker.base_url, "parked")["status"] == "queued"
        assert broker.call(runtime.redis.zcard(live)) <= 1
        assert payments.requests == []
    refused = start_turn(broker.base_url, turn_id="third", tokens=2, expect=429)
    assert refused["error"]["code"] == "too_many_streams"
    # A slot frees: the approved turn resumes, pays once and completes.
    httpx.post(f"{broker.base_url}/v1/turns/busy/cancel", timeout=10)
    assert wait_final(broker.base_url, "parked", timeout=20)["status"] == "complete"
    assert len(payments.requests) == 1
