"""The generation lifecycle: silent capped retries, interruptions, continue and regenerate,
one canonical answer, stop, and the conversation history."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import pytest

from broker.fanout import _Feed
from broker.providers import SimulatedProvider
from broker.turns import Turns
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import get_turn, read_sse, start_turn, text_of, wait_final, wait_until

FAST_RETRIES = {"retry_backoff_min_ms": 1, "retry_backoff_max_ms": 3}


@pytest.fixture
def fast(broker_factory: BrokerFactory) -> RunningBroker:
    return broker_factory(**FAST_RETRIES)


def post(broker: RunningBroker, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(f"{broker.base_url}{path}", json=body, timeout=10)


def simulated(broker: RunningBroker) -> SimulatedProvider:
    provider = broker.runtime.providers.get("simulated")
    assert isinstance(provider, SimulatedProvider)
    return provider


def reference_text(broker: RunningBroker, **knobs: Any) -> str:
    """The uninterrupted answer for the default prompt under ``knobs``."""
    turn = start_turn(broker.base_url, conversation_id="reference", tokens_per_s=0, **knobs)
    return text_of(read_sse(broker.base_url, turn["stream_id"]).events)


# --- retries before the first delta ------------------------------------------------------


def test_a_failure_before_the_first_delta_is_retried_silently(fast: RunningBroker) -> None:
    turn = start_turn(
        fast.base_url, turn_id="r1", seed=4, tokens=12, tokens_per_s=0, fail_before_first=1
    )
    events = read_sse(fast.base_url, turn["stream_id"]).events
    kinds = [e.event for e in events]
    assert kinds[0] == "attempt"
    assert "error" not in kinds
    assert kinds.count("attempt") == 1
    assert events[-1].data == {"attempt": 1, "status": "complete", "reason": None}
    assert text_of(events) == reference_text(fast, seed=4, tokens=12)
    assert (
        fast.metric("broker_retries_total", '{code="upstream_unavailable",reason="upstream_error"}')
        == 1
    )
    assert get_turn(fast.base_url, "r1")["attempts"][0]["status"] == "complete"


def test_nothing_reaches_the_stream_before_a_retry(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(retry_backoff_min_ms=300, retry_backoff_max_ms=300)
    turn = start_turn(broker.base_url, turn_id="r2", tokens=3, tokens_per_s=0, fail_before_first=1)
    events = read_sse(broker.base_url, turn["stream_id"]).events
    attempt, first_delta = events[0], events[1]
    assert (attempt.event, first_delta.event) == ("attempt", "delta")
    # Written together with the first delta, not before the failed call and its 300 ms pause.
    assert int(first_delta.id[:16]) - int(attempt.id[:16]) < 100


def test_retries_stop_at_the_per_turn_cap(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(max_attempts_per_turn=3, **FAST_RETRIES)
    began = time.monotonic()
    turn = start_turn(broker.base_url, turn_id="cap", fail_before_first=50, tokens_per_s=0)
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert time.monotonic() - began < 10
    assert [e.event for e in events] == ["attempt", "error", "end"]
    assert events[1].data["code"] == "attempts_exhausted"
    assert "3 upstream call(s)" in events[1].data["message"]
    assert events[2].data == {"attempt": 1, "status": "failed", "reason": "attempts_exhausted"}
    assert (
        broker.metric(
            "broker_retries_total", '{code="upstream_unavailable",reason="upstream_error"}'
        )
        == 2
    )
    assert broker.metric("broker_attempts_exhausted_total", '{code="upstream_unavailable"}') == 1
    assert broker.metric("broker_retry_budget_exhausted_total", '{scope="turn"}') == 1
    calls = broker.metric(
        "broker_upstream_requests_total",
        '{model="simulated",outcome="retryable_error",provider="simulated"}',
    )
    assert calls == 3


def test_retries_stop_when_the_session_budget_is_spent(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(session_retry_budget=2, max_attempts_per_turn=5, **FAST_RETRIES)

    def run(turn_id: str, session: str) -> dict[str, Any]:
        body = {
            "conversation_id": "budget",
            "turn_id": turn_id,
            "session_id": session,
            "messages": [{"role": "user", "content": turn_id}],
            "params": {"simulate": {"fail_before_first": 1, "tokens": 3, "tokens_per_s": 0}},
        }
        assert post(broker, "/v1/turns", body).status_code == 201
        return wait_final(broker.base_url, turn_id)

    assert run("b1", "alice")["status"] == "complete"
    assert run("b2", "alice")["status"] == "complete"
    spent = run("b3", "alice")
    assert spent["status"] == "failed"
    assert spent["attempts"][0]["reason"] == "retry_budget_exhausted"
    assert run("b4", "bob")["status"] == "complete"  # budgets are per session
    assert broker.metric("broker_retry_budget_exhausted_total", '{scope="session"}') == 1


def test_a_fatal_failure_is_not_retried(fast: RunningBroker) -> None:
    turn = start_turn(fast.base_url, turn_id="fatal", fail_before_first=1, error="fatal")
    events = read_sse(fast.base_url, turn["stream_id"]).events
    assert events[-1].data["status"] == "failed"
    assert events[-1].data["reason"] == "upstream_bad_request"
    assert (
        fast.metric("broker_retries_total", '{code="upstream_unavailable",reason="upstream_error"}')
        == 0
    )


# --- after the first delta -----------------------------------------------------------------


def test_a_silent_upstream_after_deltas_is_an_interruption(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(upstream_idle_timeout_s=0.2)
    turn = start_turn(
        broker.base_url, turn_id="stall", tokens=10, tokens_per_s=0, stall_after_deltas=3
    )
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert [e.event for e in events].count("delta") == 3
    assert events[-1].data == {"attempt": 1, "status": "interrupted", "reason": "upstream_timeout"}
    assert get_turn(broker.base_url, "stall")["canonical"]["text"] == text_of(events)
    assert (
        broker.metric(
            "broker_interruptions_total", '{code="upstream_timeout",reason="upstream_timeout"}'
        )
        == 1
    )


def test_continue_carries_on_from_the_delivered_text(fast: RunningBroker) -> None:
    turn = start_turn(
        fast.base_url, turn_id="cont", seed=9, tokens=20, tokens_per_s=0, fail_after_deltas=6
    )
    first = read_sse(fast.base_url, turn["stream_id"])
    partial = text_of(first.events)
    assert first.events[-1].data["status"] == "interrupted"
    response = post(fast, "/v1/turns/cont/attempts", {"strategy": "continue"})
    assert response.status_code == 201
    assert response.json()["attempts"][1]["strategy"] == "continue"
    rest = read_sse(fast.base_url, turn["stream_id"], last_event_id=first.events[-1].id)
    assert rest.events[0].data == {"attempt": 2, "strategy": "continue"}
    assert rest.events[-1].data == {"attempt": 2, "status": "complete", "reason": None}
    full = reference_text(fast, seed=9, tokens=20)
    assert partial + text_of(rest.events) == full
    state = get_turn(fast.base_url, "cont")
    assert state["canonical"] == {"attempt": 2, "text": full}
    assert [a["canonical"] for a in state["attempts"]] == [False, True]
    assert state["attempts"][1]["continues"] == 1


def test_regenerate_replaces_the_answer(fast: RunningBroker) -> None:
    turn = start_turn(fast.base_url, turn_id="regen", tokens=8, tokens_per_s=0)
    first = read_sse(fast.base_url, turn["stream_id"])
    response = post(fast, "/v1/turns/regen/attempts", {"strategy": "regenerate"})
    assert response.status_code == 201
    rest = read_sse(fast.base_url, turn["stream_id"], last_event_id=first.events[-1].id)
    assert rest.events[0].data == {"attempt": 2, "strategy": "regenerate"}
    state = get_turn(fast.base_url, "regen")
    assert state["canonical"] == {"attempt": 2, "text": text_of(rest.events)}
    assert [(a["n"], a["canonical"]) for a in state["attempts"]] == [(1, False), (2, True)]


def test_new_attempts_are_refused_while_running_or_when_they_do_not_fit(
    fast: RunningBroker,
) -> None:
    start_turn(fast.base_url, turn_id="busy", tokens=200, tokens_per_s=20)
    busy = post(fast, "/v1/turns/busy/attempts", {"strategy": "regenerate"})
    assert busy.status_code == 409
    assert busy.json()["error"]["code"] == "turn_busy"
    start_turn(fast.base_url, turn_id="done", tokens=3, tokens_per_s=0)
    wait_final(fast.base_url, "done")
    complete = post(fast, "/v1/turns/done/attempts", {"strategy": "continue"})
    assert complete.status_code == 422
    assert post(fast, "/v1/turns/done/attempts", {"strategy": "sideways"}).status_code == 400
    assert post(fast, "/v1/turns/nope/attempts", {"strategy": "regenerate"}).status_code == 404


def test_json_output_must_parse_and_cannot_be_continued(fast: RunningBroker) -> None:
    def json_turn(turn_id: str, **knobs: Any) -> dict[str, Any]:
        body = {
            "conversation_id": "json",
            "turn_id": turn_id,
            "response_format": "json",
            "messages": [{"role": "user", "content": "as json"}],
            "params": {"simulate": {"tokens": 6, "tokens_per_s": 0, **knobs}},
        }
        assert post(fast, "/v1/turns", body).status_code == 201
        return wait_final(fast.base_url, turn_id)

    good = json_turn("j1")
    assert good["status"] == "complete"
    assert isinstance(httpx.Response(200, content=good["canonical"]["text"]).json(), dict)
    prose = json_turn("j2", json=False)
    assert prose["status"] == "failed"
    assert prose["attempts"][0]["reason"] == "invalid_output"
    cut = json_turn("j3", fail_after_deltas=2)
    assert cut["status"] == "interrupted"
    refused = post(fast, "/v1/turns/j3/attempts", {"strategy": "continue"})
    assert refused.status_code == 422
    assert "json" in refused.json()["error"]["message"]
    assert post(fast, "/v1/turns/j3/attempts", {"strategy": "regenerate"}).status_code == 201


def test_concurrent_promotions_exactly_one_wins(fast: RunningBroker) -> None:
    start_turn(fast.base_url, turn_id="pick", tokens=4, tokens_per_s=0)
    wait_final(fast.base_url, "pick")
    assert post(fast, "/v1/turns/pick/attempts", {"strategy": "regenerate"}).status_code == 201
    wait_final(fast.base_url, "pick")
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        responses = list(
            pool.map(
                lambda _: post(fast, "/v1/turns/pick/canonical", {"attempt": 1, "expected": 2}),
                range(10),
            )
        )
    assert sorted(r.status_code for r in responses) == [200] + [409] * 9
    assert {r.json()["error"]["code"] for r in responses if r.status_code == 409} == {
        "canonical_changed"
    }
    state = get_turn(fast.base_url, "pick")
    assert state["canonical"]["attempt"] == 1
    assert [a["canonical"] for a in state["attempts"]] == [True, False]


# --- stop ------------------------------------------------------------------------------------


def test_stop_lands_within_a_second_and_aborts_the_upstream_call(fast: RunningBroker) -> None:
    turn = start_turn(fast.base_url, turn_id="stop", tokens=400, tokens_per_s=20)
    seen = read_sse(fast.base_url, turn["stream_id"], stop_after=4).events
    began = time.monotonic()
    response = post(fast, "/v1/turns/stop/cancel")
    assert response.status_code == 200
    final = wait_final(fast.base_url, "stop", timeout=1.0)
    assert time.monotonic() - began < 1.0
    assert final["status"] == "cancelled"
    events = read_sse(fast.base_url, turn["stream_id"]).events
    assert events[: len(seen)] == seen
    assert events[-1].data == {"attempt": 1, "status": "cancelled", "reason": "cancelled"}
    assert final["canonical"] == {"attempt": 1, "text": text_of(events)}
    assert simulated(fast).aborted_calls == 1
    outcome = '{model="simulated",outcome="cancelled",provider="simulated"}'
    assert fast.metric("broker_upstream_requests_total", outcome) == 1
    again = post(fast, "/v1/turns/stop/cancel")  # idempotent: the same state
    assert again.status_code == 200
    assert again.json()["status"] == "cancelled"
    assert len(read_sse(fast.base_url, turn["stream_id"]).events) == len(events)


@pytest.fixture
def lost_stop_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop notifications never reach the worker: it learns of a stop from the durable flag."""

    async def lost(self: Turns, conversation_id: str, turn_id: str, attempt: int) -> None:
        return None

    monkeypatch.setattr(Turns, "_notify_stop", lost)


@pytest.mark.usefixtures("lost_stop_notices")
def test_stop_reaches_the_worker_even_if_the_notification_is_lost(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(lease_ttl_ms=300, job_reclaim_idle_ms=1000)
    turn = start_turn(broker.base_url, turn_id="quiet-stop", tokens=5, tokens_per_s=0.5)
    read_sse(broker.base_url, turn["stream_id"], stop_after=2)
    post(broker, "/v1/turns/quiet-stop/cancel")
    # No delta comes for 2 s: the lease heartbeat (every 100 ms) sees the durable flag.
    assert wait_final(broker.base_url, "quiet-stop", timeout=1.5)["status"] == "cancelled"


@pytest.mark.usefixtures("lost_stop_notices")
def test_a_stop_first_seen_by_an_append_counts_the_call_cancelled(
    broker_factory: BrokerFactory,
) -> None:
    # A long lease: its heartbeat is seconds away, so the next append meets the durable flag.
    broker = broker_factory(lease_ttl_ms=30_000)
    turn = start_turn(broker.base_url, turn_id="append-stop", tokens=400, tokens_per_s=20)
    read_sse(broker.base_url, turn["stream_id"], stop_after=2)
    post(broker, "/v1/turns/append-stop/cancel")
    assert wait_final(broker.base_url, "append-stop", timeout=2.0)["status"] == "cancelled"
    labels = '{{model="simulated",outcome="{}",provider="simulated"}}'
    assert broker.metric("broker_upstream_requests_total", labels.format("cancelled")) == 1
    assert broker.metric("broker_upstream_requests_total", labels.format("ok")) == 0


def test_stop_of_a_queued_turn_ends_it_without_a_worker(broker_factory: BrokerFactory) -> None:
    api = broker_factory(role="api")
    turn = start_turn(api.base_url, turn_id="never", tokens=3)
    response = post(api, "/v1/turns/never/cancel")
    assert response.json()["status"] == "cancelled"
    events = read_sse(api.base_url, turn["stream_id"]).events
    assert [e.event for e in events] == ["attempt", "end"]
    assert events[-1].data["status"] == "cancelled"
    broker_factory(role="worker", key_prefix=api.settings.key_prefix)
    wait_until(lambda: api.metric("broker_cancels_total", '{result="cancelled"}') == 1)
    # A worker that picks up the stale job writes nothing.
    assert len(read_sse(api.base_url, turn["stream_id"]).events) == 2


def test_a_disconnect_is_not_a_stop(fast: RunningBroker) -> None:
    turn = start_turn(fast.base_url, turn_id="leave", tokens=30, tokens_per_s=100)
    read_sse(fast.base_url, turn["stream_id"], stop_after=2)
    assert wait_final(fast.base_url, "leave")["status"] == "complete"


# --- readers and history -----------------------------------------------------------------------


def test_a_reader_without_live_notifications_still_ends(
    broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def deaf(self: _Feed) -> None:
        import asyncio

        await asyncio.Event().wait()

    monkeypatch.setattr(_Feed, "run", deaf)
    broker = broker_factory(sse_heartbeat_s=0.2)
    turn = start_turn(broker.base_url, turn_id="deaf", tokens=10, tokens_per_s=20)
    read = read_sse(broker.base_url, turn["stream_id"], timeout=10)
    assert read.ended_by_server
    assert read.events[-1].data["status"] == "complete"
    assert [e.event for e in read.events].count("delta") == 10


def test_history_has_one_canonical_answer_per_turn(fast: RunningBroker) -> None:
    def turn(turn_id: str, messages: list[dict[str, Any]], **knobs: Any) -> dict[str, Any]:
        body = {
            "conversation_id": "hist",
            "turn_id": turn_id,
            "messages": messages,
            "params": {"simulate": {"tokens": 5, "tokens_per_s": 0, **knobs}},
        }
        assert post(fast, "/v1/turns", body).status_code == 201
        return wait_final(fast.base_url, turn_id)

    system = {"role": "system", "content": "be brief"}
    first = turn("h1", [system, {"role": "user", "content": "one"}])
    assert post(fast, "/v1/turns/h1/attempts", {"strategy": "regenerate"}).status_code == 201
    first = wait_final(fast.base_url, "h1")
    history = httpx.get(f"{fast.base_url}/v1/conversations/hist/messages", timeout=5).json()
    second_input = [*history["messages"], {"role": "user", "content": "two"}]
    second = turn("h2", second_input, fail_after_deltas=2)
    history = httpx.get(f"{fast.base_url}/v1/conversations/hist/messages", timeout=5).json()
    assert history["messages"] == [
        system,
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": first["canonical"]["text"]},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": second["canonical"]["text"], "partial": True},
    ]
    assert [t["canonical"] for t in history["turns"]] == [2, 1]
    # The history is sendable as it is, partial flag included.
    third = turn("h3", [*history["messages"], {"role": "user", "content": "three"}])
    assert third["status"] == "complete"
    missing = httpx.get(f"{fast.base_url}/v1/conversations/nobody/messages", timeout=5)
    assert missing.status_code == 404


def test_a_new_attempt_is_answered_queued_whatever_the_worker_does(fast: RunningBroker) -> None:
    # Regression (issue 34, finding 12): the answer was read after the job was queued, so it
    # said `queued` or `streaming` as the worker's timing fell (the README showed `queued`).
    for n in range(4):
        turn_id = f"queued-{n}"
        start_turn(fast.base_url, turn_id=turn_id, tokens=6, tokens_per_s=0, fail_after_deltas=2)
        assert wait_final(fast.base_url, turn_id)["status"] == "interrupted"
        strategy = ("continue", "regenerate")[n % 2]
        response = post(fast, f"/v1/turns/{turn_id}/attempts", {"strategy": strategy})
        assert response.status_code == 201
        answer = response.json()
        assert (answer["status"], answer["attempt"]) == ("queued", 2)
        assert [a["status"] for a in answer["attempts"]] == ["partial", "queued"]
        assert wait_final(fast.base_url, turn_id)["status"] == "complete"
