"""Tool approvals through the OpenAI Responses door, with the official openai SDK: a pending
approval is an ``mcp_approval_request`` output item, the answer an ``mcp_approval_response``
input item, and the new response is the same turn's continuation."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_input_param import McpApprovalResponse
from pydantic import TypeAdapter

from broker.approval_rules import set_clock
from tests.approval_fixtures import BIG
from tests.conftest import BrokerProcess, RunningBroker, _prefixes
from tests.doc_pages import ROOT, snippets
from tests.helpers import ToolEndpoint, get_turn, read_sse, wait_final
from tests.openai_spec import event_errors, sdk_extras, spec_errors
from tests.test_approvals import decide, wait_awaiting

EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
ANSWER: TypeAdapter[Any] = TypeAdapter(McpApprovalResponse)


def sdk_of(broker: RunningBroker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{broker.base_url}/v1", api_key="unused", max_retries=0)


def pay(sdk: openai.OpenAI, response_id: str, **options: Any) -> Any:
    """A response whose model calls send_payment over the approval threshold."""
    script = [{"name": "send_payment", "args": BIG, "after": 3}]
    simulate = {"tokens": 8, "tokens_per_s": 0, "tool_calls": script}
    return sdk.responses.create(
        model="simulated",
        input="pay bob",
        extra_headers={"Idempotency-Key": response_id},
        extra_body={"broker": {"params": {"simulate": simulate}}},
        **options,
    )


def answer(approval_id: str, approve: bool, reason: str | None = None) -> McpApprovalResponse:
    item: McpApprovalResponse = {
        "type": "mcp_approval_response",
        "approval_request_id": approval_id,
        "approve": approve,
    }
    if reason is not None:
        item["reason"] = reason
    return item


def check_response(value: dict[str, Any]) -> Response:
    assert spec_errors("Response", value) == []
    parsed = Response.model_validate(value)
    assert sdk_extras(parsed) == []
    return parsed


def check_events(events: list[Any]) -> list[dict[str, Any]]:
    """The SDK's parsed events as raw JSON, each checked against the spec and the SDK."""
    raw = [event.model_dump(mode="json", exclude_unset=True) for event in events]
    for event in raw:
        assert event_errors(event) == [], event
        assert sdk_extras(EVENT.validate_python(event)) == []
    numbers = [event["sequence_number"] for event in raw]
    assert numbers == list(range(len(raw)))
    return raw


def request_items(response: Response) -> list[Any]:
    return [item for item in response.output if item.type == "mcp_approval_request"]


def test_a_pending_approval_is_an_mcp_approval_request_and_the_response_ends_there(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    sdk = sdk_of(approved_broker)
    events = list(pay(sdk, "pay-stream", stream=True))
    raw = check_events(events)
    assert raw[-1]["type"] == "response.completed"
    done = check_response(raw[-1]["response"])
    (message, request) = done.output
    assert message.type == "message"
    assert message.status == "completed"
    (pending,) = get_turn(approved_broker.base_url, "pay-stream")["approvals"]
    assert request.type == "mcp_approval_request"
    assert request.id == pending["approval_id"]
    assert (request.name, request.server_label) == ("send_payment", "broker")
    assert orjson.loads(request.arguments) == BIG
    added = [e["item"] for e in raw if e["type"] == "response.output_item.added"]
    assert [item["type"] for item in added] == ["message", "mcp_approval_request"]
    assert done.output_text == "".join(
        e["delta"] for e in raw if e["type"] == "response.output_text.delta"
    )
    # Non-streaming, and read back: the same response, waiting for the same person.
    whole = pay(sdk, "pay-whole")
    assert whole.status == "completed"
    assert [item.type for item in request_items(whole)] == ["mcp_approval_request"]
    again = sdk.responses.retrieve("pay-stream")
    check_response(again.model_dump(mode="json", exclude_unset=True))
    assert [item.id for item in request_items(again)] == [request.id]
    assert payments.requests == []


def test_approving_streams_the_same_turn_s_continuation_and_pays_once(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    sdk = sdk_of(broker)
    first = pay(sdk, "pay-ok")
    (request,) = request_items(first)
    item = answer(request.id, True)
    assert ANSWER.validate_python(item) == item
    # The published document requires a `request_id` its schema never defines: the only error.
    assert [e for e in spec_errors("MCPApprovalResponse", item) if "request_id" not in e] == []
    events = list(
        sdk.responses.create(
            model="simulated", previous_response_id=first.id, input=[item], stream=True
        )
    )
    raw = check_events(events)
    done = check_response(raw[-1]["response"])
    assert raw[-1]["type"] == "response.completed"
    assert done.id == f"pay-ok:{request.id}"
    assert done.previous_response_id == "pay-ok"
    assert request_items(done) == []
    final = wait_final(broker.base_url, "pay-ok")
    assert final["status"] == "complete"
    assert first.output_text + done.output_text == final["canonical"]["text"]
    assert len(payments.requests) == 1
    # Read back by its id; and a native reader of the turn saw the decision and the result.
    again = sdk.responses.retrieve(done.id)
    check_response(again.model_dump(mode="json", exclude_unset=True))
    assert (again.id, again.status, again.output_text) == (done.id, "completed", done.output_text)
    native = read_sse(broker.base_url, get_turn(broker.base_url, "pay-ok")["stream_id"]).events
    decision = next(e for e in native if e.event == "approval_decision")
    assert (decision.data["decision"], decision.data["by"]) == ("approve", "person")
    assert [e.data["source"] for e in native if e.event == "tool_result"] == ["ran"]
    # The continuation is a previous_response_id like any other: its context is the turn's.
    follow_up = sdk.responses.create(
        model="simulated", previous_response_id=done.id, input="thanks"
    )
    assert follow_up.status == "completed"
    assert follow_up.previous_response_id == done.id
    assert len(payments.requests) == 1


def test_approving_without_streaming_answers_the_continuation_once_it_ended(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    sdk = sdk_of(approved_broker)
    first = pay(sdk, "pay-json", stream=False)
    (request,) = request_items(first)
    done = sdk.responses.create(
        model="simulated", previous_response_id=first.id, input=[answer(request.id, True)]
    )
    check_response(done.model_dump(mode="json", exclude_unset=True))
    assert done.status == "completed"
    assert done.id == f"pay-json:{request.id}"
    assert done.output_text
    assert wait_final(approved_broker.base_url, "pay-json")["status"] == "complete"
    assert len(payments.requests) == 1


def test_deny_tells_the_model_and_the_answer_goes_on(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    sdk = sdk_of(broker)
    first = pay(sdk, "pay-no")
    (request,) = request_items(first)
    done = sdk.responses.create(
        model="simulated",
        previous_response_id=first.id,
        input=[answer(request.id, False, "too much")],
    )
    assert done.status == "completed"
    assert done.output_text
    native = read_sse(broker.base_url, get_turn(broker.base_url, "pay-no")["stream_id"]).events
    result = next(e for e in native if e.event == "tool_result")
    assert result.data["error"]["code"] == "approval_denied"
    assert "too much" in result.data["error"]["message"]
    assert payments.requests == []


def test_the_same_answer_twice_and_from_two_clients_decides_once_and_pays_once(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    sdk = sdk_of(broker)
    first = pay(sdk, "pay-twice")
    (request,) = request_items(first)
    ids: list[str] = []

    def client() -> None:
        done = sdk_of(broker).responses.create(
            model="simulated", previous_response_id=first.id, input=[answer(request.id, True)]
        )
        ids.append(done.id)

    threads = [threading.Thread(target=client) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    client()  # and once more, later
    assert ids == [f"pay-twice:{request.id}"] * 3
    assert len(payments.requests) == 1
    assert broker.metric("broker_approvals_decided_total", '{by="person",decision="approve"}') == 1


def test_a_conflicting_answer_is_a_409_naming_the_decision_that_stands(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    sdk = sdk_of(broker)
    first = pay(sdk, "pay-conflict")
    (request,) = request_items(first)
    assert decide(broker, "pay-conflict", request.id, "approve").status_code == 200
    with pytest.raises(openai.ConflictError) as raised:
        sdk.responses.create(
            model="simulated", previous_response_id=first.id, input=[answer(request.id, False)]
        )
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["code"] == "approval_decided"
    assert "approve" in error["message"]
    assert "stands" in error["message"]
    wait_final(broker.base_url, "pay-conflict")
    assert len(payments.requests) == 1


def test_an_answer_after_the_expiry_meets_the_expiry_s_denial(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    sdk = sdk_of(broker)
    first = pay(sdk, "pay-late")
    (pending,) = wait_awaiting(broker, "pay-late")["approvals"]
    with (
        set_clock(lambda: pending["expires_at"] + 1),
        pytest.raises(openai.ConflictError) as raised,
    ):
        sdk.responses.create(
            model="simulated",
            previous_response_id=first.id,
            input=[answer(pending["approval_id"], True)],
        )
    message = raised.value.message
    assert "deny" in message
    assert "expired" in message
    # The continuation shows what the model was told: the answer went on without the payment.
    done = sdk.responses.retrieve(f"pay-late:{pending['approval_id']}")
    wait_final(broker.base_url, "pay-late")
    assert done.id == f"pay-late:{pending['approval_id']}"
    assert payments.requests == []


@pytest.mark.parametrize(
    ("input_items", "previous", "code"),
    [
        ([answer("apr_" + "0" * 24, True)], "own", "unknown_approval_request"),
        ([answer("not-an-approval", True)], "own", "unknown_approval_request"),
        ([answer("other", True)], "own", "unknown_approval_request"),
        (
            [answer("own", True), {"role": "user", "content": "and also"}],
            "own",
            "mixed_approval_input",
        ),
        ([answer("own", True), answer("own", False)], "own", "conflicting_approval_input"),
        ([{"type": "mcp_approval_response", "approval_request_id": "own"}], "own", None),
        ([answer("own", True)], None, "missing_previous_response"),
        ([answer("own", True)], "nobody", "previous_response_not_found"),
    ],
)
def test_bad_answers_are_400s_in_openai_s_shape_and_decide_nothing(
    approved_broker: RunningBroker,
    payments: ToolEndpoint,
    input_items: list[dict[str, Any]],
    previous: str | None,
    code: str | None,
) -> None:
    broker = approved_broker
    sdk = sdk_of(broker)
    own = request_items(pay(sdk, "bad-own"))[0].id
    other = request_items(pay(sdk, "bad-other"))[0].id
    names = {"own": own, "other": other}
    items = [
        {**i, "approval_request_id": names.get(i["approval_request_id"], i["approval_request_id"])}
        if "approval_request_id" in i
        else i
        for i in input_items
    ]
    body: dict[str, Any] = {"model": "simulated", "input": items}
    if previous is not None:
        body["previous_response_id"] = "bad-own" if previous == "own" else previous
    response = httpx.post(f"{broker.base_url}/v1/responses", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    for turn_id in ("bad-own", "bad-other"):
        assert get_turn(broker.base_url, turn_id)["status"] == "awaiting_approval"
    assert payments.requests == []


@pytest.mark.server
def test_the_openai_page_s_approval_example_pays_once(
    broker_processes: Callable[[dict[str, str]], BrokerProcess],
    redis_url: str,
    tmp_path: Path,
) -> None:
    """The example of docs/openai.md's "Tool approvals", run verbatim against `broker serve`
    with the payments example's tools file (its endpoint on a free port)."""
    (code,) = snippets("openai.md", "Tool approvals", "python")
    assert "http://127.0.0.1:8000/v1" in code
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "examples/payments/server.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        match = re.fullmatch(
            r"payments serving on (http://127\.0\.0\.1:\d+)\n", server.stdout.readline()
        )
        assert match is not None
        tools = (ROOT / "examples/payments/tools.json").read_text()
        assert "http://127.0.0.1:9000" in tools
        path = tmp_path / "tools.json"
        path.write_text(tools.replace("http://127.0.0.1:9000", match[1]))
        broker = broker_processes(
            {
                "BROKER_REDIS_URL": redis_url,
                "BROKER_KEY_PREFIX": f"docs-openai-approvals-{next(_prefixes)}",
                "BROKER_TOOLS": str(path),
            }
        )
        run = subprocess.run(
            [sys.executable, "-c", code.replace("http://127.0.0.1:8000", broker.base_url)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=dict(os.environ),
        )
        assert run.returncode == 0, run.stderr
        # (The continuation's text may span lines.)
        asked, *rest, refused = run.stdout.strip().splitlines()
        continued = "\n".join(rest)
        assert asked == "completed send_payment {'amount': 500, 'to': 'bob'}"
        assert continued.startswith("True ")
        assert len(continued) > len("True ") + 10
        assert refused == "409"
        assert httpx.get(f"{match[1]}/payments", timeout=5).json()["count"] == 1
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_two_requests_of_one_message_are_answered_together(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    sdk = sdk_of(broker)
    script = [
        {"name": "send_payment", "args": BIG, "after": 3},
        {"name": "send_payment", "args": {"to": "carol", "amount": 700}, "after": 3},
    ]
    first = sdk.responses.create(
        model="simulated",
        input="pay bob and carol",
        extra_headers={"Idempotency-Key": "pay-both"},
        extra_body={"broker": {"params": {"simulate": {"tokens": 8, "tool_calls": script}}}},
    )
    bob, carol = request_items(first)
    assert [orjson.loads(r.arguments)["to"] for r in (bob, carol)] == ["bob", "carol"]
    # One answer alone would leave the continuation waiting for the other: refused, undecided.
    with pytest.raises(openai.BadRequestError) as partial:
        sdk.responses.create(
            model="simulated", previous_response_id=first.id, input=[answer(bob.id, True)]
        )
    assert partial.value.code == "approval_requests_unanswered"
    assert carol.id in partial.value.message
    assert len(get_turn(broker.base_url, "pay-both")["approvals"]) == 2
    done = sdk.responses.create(
        model="simulated",
        previous_response_id=first.id,
        input=[answer(bob.id, True), answer(carol.id, False)],
    )
    assert done.status == "completed"
    assert done.id in (f"pay-both:{bob.id}", f"pay-both:{carol.id}")
    assert done.output_text
    assert wait_final(broker.base_url, "pay-both")["status"] == "complete"
    assert [r["body"]["arguments"]["to"] for r in payments.requests] == ["bob"]


def test_stopping_a_continuation_stops_its_turn(
    approved_broker: RunningBroker, payments: ToolEndpoint
) -> None:
    broker = approved_broker
    sdk = sdk_of(broker)
    script = [{"name": "send_payment", "args": BIG, "after": 3}]
    simulate = {"tokens": 2000, "tokens_per_s": 20, "tool_calls": script}
    first = sdk.responses.create(
        model="simulated",
        input="pay bob, then talk",
        extra_headers={"Idempotency-Key": "pay-stop"},
        extra_body={"broker": {"params": {"simulate": simulate}}},
    )
    (request,) = request_items(first)
    running = sdk.responses.create(
        model="simulated",
        previous_response_id=first.id,
        input=[answer(request.id, True)],
        background=True,
    )
    assert running.id == f"pay-stop:{request.id}"
    stopped = sdk.responses.cancel(running.id)
    assert stopped.id == running.id
    assert stopped.status == "cancelled"
    assert wait_final(broker.base_url, "pay-stop")["status"] == "cancelled"
