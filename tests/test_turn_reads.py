"""The core's reads every door needs (``Turns``), typed, on a real broker and its Redis; and the
Responses seek (``SequenceIndex``): bounded steps that land where one unbounded walk would."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from broker.dialects.openai.events import EXPANSION, OPENING, expansion
from broker.reader import Location
from broker.sequence_index import SequenceIndex
from broker.turn_records import AttemptRecord, StoredRequest
from tests.conftest import RunningBroker
from tests.helpers import read_sse, start_turn, text_of, wait_final


def test_a_turn_is_found_with_its_request(broker: RunningBroker) -> None:
    turn = start_turn(broker.base_url, "reads-1", turn_id="find-1", tokens=3, tokens_per_s=0)
    turns = broker.runtime.turns
    found = broker.call(turns.find("find-1", None))
    assert found is not None
    assert (found.turn_id, found.conversation_id) == ("find-1", "reads-1")
    assert found.stream_id == turn["stream_id"]
    assert found.created_ms > 0
    assert found.request.conversation_id == "reads-1"
    assert found.request.messages == (
        {"role": "user", "content": "Tell me about streams", "name": None},
    )
    assert found.request.params["simulate"]["tokens"] == 3
    assert broker.call(turns.request("reads-1", "find-1")) == found.request
    # Unknown, malformed, or another tenant's: nothing, and no error.
    assert broker.call(turns.find("nobody", None)) is None
    assert broker.call(turns.find("bad id!", None)) is None
    assert broker.call(turns.find("find-1", "other-tenant")) is None


def test_an_attempt_is_read_with_its_record_and_text(broker: RunningBroker) -> None:
    start_turn(broker.base_url, "reads-2", turn_id="att-1", tokens=5, tokens_per_s=0)
    state = wait_final(broker.base_url, "att-1")
    turns = broker.runtime.turns
    record = broker.call(turns.attempt_record("reads-2", "att-1", 1))
    assert isinstance(record, AttemptRecord)
    assert (record.n, record.strategy, record.status) == (1, "initial", "complete")
    assert record.usage is not None
    assert record.usage["output_tokens"] > 0
    assert record.continues is None
    assert broker.call(turns.attempt_record("reads-2", "att-1", 2)) is None
    ended = broker.call(turns.attempt("reads-2", "att-1", 1))
    assert ended.text == ended.own_text == state["canonical"]["text"]
    assert broker.call(turns.text_so_far("reads-2", "att-1", 1)) == state["canonical"]["text"]
    assert broker.call(turns.text_so_far("reads-2", "att-1", 2)) == ""
    assert broker.call(turns.at_rest("reads-2", "att-1", 1)) is True
    assert broker.call(turns.at_rest("reads-2", "att-1", 2)) is False
    assert broker.call(turns.at_rest("reads-2", "gone", 1)) is True  # expired: at rest


def test_a_continue_holds_its_own_text_after_the_partial(broker: RunningBroker) -> None:
    start_turn(
        broker.base_url, "reads-3", turn_id="cont-1", tokens=12, tokens_per_s=0, fail_after_deltas=4
    )
    assert wait_final(broker.base_url, "cont-1")["status"] == "interrupted"
    started = httpx.post(
        f"{broker.base_url}/v1/turns/cont-1/attempts", json={"strategy": "continue"}, timeout=10
    )
    assert started.status_code == 201, started.text
    final = wait_final(broker.base_url, "cont-1")
    turns = broker.runtime.turns
    partial = broker.call(turns.attempt("reads-3", "cont-1", 1))
    ended = broker.call(turns.attempt("reads-3", "cont-1", 2))
    assert ended.record is not None
    assert ended.record.continues == 1
    assert ended.text == final["canonical"]["text"]
    assert ended.text == partial.text + ended.own_text
    assert ended.own_text
    assert partial.text
    # The turn is at rest on its second attempt, not on its first.
    assert broker.call(turns.at_rest("reads-3", "cont-1", 2)) is True
    assert broker.call(turns.at_rest("reads-3", "cont-1", 1)) is False


def test_the_latest_turn_of_a_conversation(broker: RunningBroker) -> None:
    turns = broker.runtime.turns
    assert broker.call(turns.latest("reads-4", None)) is None
    start_turn(broker.base_url, "reads-4", turn_id="first", tokens=1, tokens_per_s=0)
    wait_final(broker.base_url, "first")
    start_turn(broker.base_url, "reads-4", turn_id="second", tokens=1, tokens_per_s=0)
    assert broker.call(turns.latest("reads-4", None)) == "second"
    assert broker.call(turns.latest("reads-4", "other-tenant")) is None
    assert broker.call(turns.latest("bad id!", None)) is None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, StoredRequest("", (), None, None, {})),
        (
            '{"conversation_id":"c","messages":[{"role":"user","content":"hi"}],'
            '"provider":"simulated","model":null,"params":{"temperature":0.5}}',
            StoredRequest(
                "c", ({"role": "user", "content": "hi"},), "simulated", None, {"temperature": 0.5}
            ),
        ),
        (
            '{"conversation_id":"c","messages":[],"client_tools":[{"name":"f"}]}',
            StoredRequest("c", (), None, None, {}, client_tools=({"name": "f"},)),
        ),
    ],
)
def test_a_stored_request_decodes(raw: str | None, expected: StoredRequest) -> None:
    assert StoredRequest.decode(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        ("", None),
        (
            '{"n":1,"strategy":"initial","status":"complete","reason":null,"canonical":true,'
            '"usage":{"output_tokens":3}}',
            AttemptRecord(1, "initial", "complete", None, True, {"output_tokens": 3}, None),
        ),
        (
            '{"n":2,"strategy":"continue","status":"queued","reason":null,"canonical":false,'
            '"base":"1","from":1}',
            AttemptRecord(2, "continue", "queued", None, False, None, 1),
        ),
        # A regenerate names the attempt it follows, but continues none.
        (
            '{"n":3,"strategy":"regenerate","status":"partial","reason":"cut","canonical":false,'
            '"from":2}',
            AttemptRecord(3, "regenerate", "partial", "cut", False, None, None),
        ),
        # An attempt that ended with client tool calls keeps them.
        (
            '{"n":1,"strategy":"initial","status":"requires_action","reason":"tool_calls",'
            '"canonical":true,"tool_calls":[{"call_id":"call_1","name":"f","arguments":"{}"}]}',
            AttemptRecord(
                1,
                "initial",
                "requires_action",
                "tool_calls",
                True,
                None,
                None,
                ({"call_id": "call_1", "name": "f", "arguments": "{}"},),
            ),
        ),
    ],
)
def test_an_attempt_record_decodes(raw: str | None, expected: AttemptRecord | None) -> None:
    assert AttemptRecord.decode(raw) == expected


# --- the Responses seek ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "data", "count"),
    [
        ("attempt", {"attempt": 1}, 2),
        ("attempt", {"attempt": 2}, 3),
        ("attempt", {}, 3),
        ("delta", {"attempt": 1, "text": "x"}, 1),
        ("end", {"attempt": 1, "status": "complete"}, 4),
        ("usage", {"attempt": 1}, 0),
        ("tool_call", {"attempt": 1}, 0),
        ("error", {"attempt": 1}, 0),
    ],
)
def test_the_expansion_table(kind: str, data: dict[str, Any], count: int) -> None:
    assert expansion(kind, data) == count


def expected_seek(entries: list[tuple[str, str, dict[str, Any]]], target: int) -> tuple[str, int]:
    """Where a read after sequence number ``target`` resumes, counted in Python from the stored
    events with the dialect's table: (entry id to read after, the number of what follows it)."""
    after, base = "0-0", OPENING
    for entry_id, kind, data in entries:
        count = expansion(kind, data)
        if base + count - 1 > target:
            break
        after, base = entry_id, base + count
    return after, base


def test_a_bounded_seek_lands_where_one_walk_does(broker: RunningBroker, raw_redis: Any) -> None:
    """Regression guard for the bounded walk: steps of a few entries, continued from where
    each stopped (with and without checkpoints), find the same points as a count in Python."""
    turn = start_turn(broker.base_url, "seek-1", turn_id="seek-1", tokens=150, tokens_per_s=0)
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert len(text_of(events)) > 0
    deps = broker.runtime.deps
    key = deps.keys.events("seek-1", "seek-1")
    checkpoints = deps.keys.responses_seq("seek-1", "seek-1")
    location = Location(turn["stream_id"], "seek-1", "seek-1")
    entries = [(i, f["e"], orjson.loads(f.get("d", "{}"))) for i, f in raw_redis.xrange(key)]
    last = OPENING + sum(expansion(kind, data) for _, kind, data in entries) - 1
    assert last > 150
    small = SequenceIndex(deps, limit=5)
    for target in [*range(OPENING - 1, last + 2, 7), last - 1, last, last + 1]:
        expected = expected_seek(entries, target)
        raw_redis.delete(checkpoints)  # the first seek walks from the start, in steps
        for _ in range(2):  # then again, from the checkpoints the steps left
            seek = broker.call(small.seek(location, target, first=OPENING, expansion=EXPANSION))
            assert (seek.after.entry_id, seek.base) == expected, target
    assert raw_redis.pttl(checkpoints) > 0


def test_one_step_of_the_seek_walks_at_most_its_limit(
    broker: RunningBroker, raw_redis: Any
) -> None:
    start_turn(broker.base_url, "seek-2", turn_id="seek-2", tokens=40, tokens_per_s=0)
    wait_final(broker.base_url, "seek-2")
    deps = broker.runtime.deps
    key = deps.keys.events("seek-2", "seek-2")
    entries = raw_redis.xrange(key)
    step = broker.call(
        deps.scripts.seek_sequence(
            events_key=key,
            checkpoints=deps.keys.responses_seq("seek-2", "seek-2"),
            starting_after=10_000,
            first=OPENING,
            every=64,
            ttl_ms=60_000,
            limit=3,
            expansion=EXPANSION,
        )
    )
    assert not step.done
    assert step.after == entries[2][0]  # three entries walked: attempt, two deltas
    assert step.base == OPENING + 2 + 1 + 1
    last = broker.call(
        deps.scripts.seek_sequence(
            events_key=key,
            checkpoints=deps.keys.responses_seq("seek-2", "seek-2"),
            starting_after=10_000,
            first=OPENING,
            every=64,
            ttl_ms=60_000,
            limit=len(entries) + 1,
            expansion=EXPANSION,
            resume=(step.after, step.base),
        )
    )
    assert last.done
    assert last.after == entries[-1][0]  # past the end: after the last entry
