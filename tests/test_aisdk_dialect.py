"""The AI SDK dialect (``/v1/ui/chat``): the real ``ai`` package is the client, on a live broker."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import ToolEndpoint, missing_tool

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "tests/node/ai-sdk"


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        missing_tool("node is not installed (the AI SDK tests need Node >= 20)")
    if not (NODE_DIR / "node_modules/ai").is_dir():
        missing_tool("tests/node/ai-sdk has no node_modules: run `npm ci` there")
    return node


def run_node_tests(broker: RunningBroker, script: str, passes: int) -> None:
    """Run one of tests/node/ai-sdk/test's files against ``broker``; every test passes."""
    result = subprocess.run(
        [_node(), "--test", "--test-timeout=60000", f"test/{script}"],
        cwd=NODE_DIR,
        env={**os.environ, "BROKER_URL": broker.base_url},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"node --test failed:\n{result.stdout}\n{result.stderr}"
    assert "# fail 0" in result.stdout
    assert f"# pass {passes}\n" in result.stdout  # every test ran


def test_the_ai_sdk_transport_and_reader_against_a_live_broker(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    _node()  # skipped before anything starts when Node or the packages are missing
    weather = ToolEndpoint("/weather", lambda n: {"sky": "clear", "call": n})
    tools = tmp_path / "tools.json"
    tools.write_text(
        json.dumps(
            {
                "tools": [
                    {
                        "name": "get_weather",
                        "class": "read",
                        "schema": {"type": "object"},
                        "endpoint": weather.url,
                    },
                ]
            }
        )
    )
    broker = broker_factory(tools=str(tools))
    try:
        run_node_tests(broker, "chat.test.mjs", 10)
    finally:
        weather.close()
    assert weather.bodies == [{"name": "get_weather", "arguments": {"city": "Oslo"}}], (
        "the tool ran once, through the ledger"
    )


def test_client_tools_run_in_the_ai_sdk_chat_against_a_live_broker(
    broker_factory: BrokerFactory,
) -> None:
    """Two client tools run by the package's Chat, a cut mid-call resumed, a regenerate."""
    run_node_tests(broker_factory(), "tools.test.mjs", 7)


def test_a_client_tool_named_as_a_server_tool_is_a_400_naming_it(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    tools = tmp_path / "tools.json"
    server_tool = {"name": "get_weather", "class": "read", "endpoint": "http://127.0.0.1:9/"}
    tools.write_text(json.dumps({"tools": [server_tool]}))
    broker = broker_factory(tools=str(tools))
    body = _chat("c-clash", "m-clash", tools={"get_time": {}, "get_weather": {}})
    response = httpx.post(f"{broker.base_url}/v1/ui/chat", json=body, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(
        "tools.get_weather is a server tool of this broker"
    )


def _chat(chat_id: str, message_id: str, **extra: object) -> dict[str, object]:
    return {
        "id": chat_id,
        "messages": [{"id": message_id, "role": "user", "parts": [{"type": "text", "text": "hi"}]}],
        "trigger": "submit-message",
        "messageId": None,
        "params": {"simulate": {"seed": 1, "tokens": 8, "tokens_per_s": 0}},
        **extra,
    }


def test_the_stream_has_the_ui_message_headers_and_offsets_as_event_ids(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory()
    with httpx.Client(base_url=broker.base_url, timeout=20) as http:
        response = http.post("/v1/ui/chat", json=_chat("chat-h", "msg-h"))
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
        assert response.headers["x-accel-buffering"] == "no"
        assert response.headers["cache-control"] == "no-cache"
        assert response.text.endswith("data: [DONE]\n\n")
        frame_ids = [line[4:] for line in response.text.splitlines() if line.startswith("id: ")]
        turn = http.get("/v1/turns/msg-h").json()
        page = http.get(f"/v1/streams/{turn['stream_id']}", params={"format": "json"}).json()
        shown = [e["id"] for e in page["events"] if e["event"] != "usage"]
        assert frame_ids == shown  # each event's frames end with its offset, in order

        # With an offset, only what follows it; after the end, nothing follows: 204 at once.
        resumed = http.get("/v1/ui/chat/chat-h/stream", headers={"Last-Event-ID": shown[1]})
        assert resumed.status_code == 200
        assert [line[4:] for line in resumed.text.splitlines() if line.startswith("id: ")] == (
            shown[2:]
        )
        assert resumed.text.endswith("data: [DONE]\n\n")
        assert http.get("/v1/ui/chat/chat-h/stream", params={"offset": shown[-1]}).status_code == (
            204
        )
        assert http.get("/v1/ui/chat/chat-h/stream").status_code == 204
        assert http.get("/v1/ui/chat/nobody/stream").status_code == 204


BAD_BODIES: list[tuple[str, object]] = [
    ("not an object", ["x"]),
    ("no messages", {"id": "c1", "messages": [], "trigger": "submit-message"}),
    ("unknown trigger", {**_chat("c1", "m1"), "trigger": "resume-stream"}),
    ("message without parts", {**_chat("c1", "m1"), "messages": [{"id": "m1", "role": "user"}]}),
    ("bad role", {**_chat("c1", "m1"), "messages": [{"id": "m1", "role": "robot", "parts": []}]}),
    (
        "text part without text",
        {
            **_chat("c1", "m1"),
            "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text"}]}],
        },
    ),
    (
        "parts not a list",
        {**_chat("c1", "m1"), "messages": [{"id": "m1", "role": "user", "parts": "hi"}]},
    ),
    (
        "last message not the user's",
        {
            **_chat("c1", "m1"),
            "messages": [
                {"id": "m1", "role": "assistant", "parts": [{"type": "text", "text": "x"}]}
            ],
        },
    ),
    ("unusable message id", _chat("c1", "m 1/../x")),
    ("unusable chat id", _chat("c 1/x", "m1")),
    ("unknown body field", {**_chat("c1", "m1"), "temperature": 2}),
    ("unknown simulate knob", {**_chat("c1", "m1"), "params": {"simulate": {"nope": 1}}}),
    ("unusable tool name", {**_chat("c1", "m1"), "tools": {"get weather": {}}}),
    ("unknown tool field", {**_chat("c1", "m1"), "tools": {"f": {"parameters": {}}}}),
    (
        "tool call without its output",
        {
            **_chat("c1", "m1"),
            "messages": [
                {"id": "m1", "role": "user", "parts": [{"type": "text", "text": "hi"}]},
                {
                    "id": "m1-reply",
                    "role": "assistant",
                    "parts": [
                        {"type": "tool-f", "toolCallId": "call_1", "state": "input-available"}
                    ],
                },
            ],
        },
    ),
]


@pytest.mark.parametrize(("case", "body"), BAD_BODIES, ids=[c for c, _ in BAD_BODIES])
def test_bad_chat_requests_are_400_with_the_broker_error_shape(
    broker_factory: BrokerFactory, case: str, body: object
) -> None:
    broker = broker_factory()
    response = httpx.post(f"{broker.base_url}/v1/ui/chat", json=body, timeout=10)
    assert response.status_code == 400, (case, response.text)
    error = response.json()["error"]
    assert set(error) == {"code", "message"}, case
    assert error["message"], case


def test_malformed_json_and_offsets_are_400(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    with httpx.Client(base_url=broker.base_url, timeout=10) as http:
        response = http.post(
            "/v1/ui/chat", content=b"{", headers={"content-type": "application/json"}
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "bad_json"
        response = http.get("/v1/ui/chat/c1/stream", params={"offset": "later"})
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "bad_offset"
        assert http.post("/v1/ui/chat/none-such/stop").status_code == 404
        assert http.post("/v1/ui/chat/none-such/continue").status_code == 404


def test_a_chat_is_its_tenants_own(broker_factory: BrokerFactory) -> None:
    """Two tenants may use one chat id and one message id: neither meets the other's turn."""
    key_a, key_b = "key-acme-0123456789abcdef", "key-beta-0123456789abcdef"
    broker = broker_factory(api_keys=f"acme={key_a},beta={key_b}")
    a = {"Authorization": f"Bearer {key_a}"}
    b = {"Authorization": f"Bearer {key_b}"}
    slow = {"params": {"simulate": {"seed": 1, "tokens": 400, "tokens_per_s": 20}}}
    with httpx.Client(base_url=broker.base_url, timeout=20) as http:
        assert http.post("/v1/ui/chat", json=_chat("shared", "m-1")).status_code == 401
        with http.stream("POST", "/v1/ui/chat", json=_chat("shared", "m-1", **slow), headers=a):
            assert http.get("/v1/turns/m-1", headers=a).json()["status"] in ("queued", "streaming")
            assert http.get("/v1/ui/chat/shared/stream", headers=b).status_code == 204
            assert http.post("/v1/ui/chat/shared/stop", headers=b).status_code == 404
            response = http.post("/v1/ui/chat", json=_chat("shared", "m-1"), headers=b)
            assert response.status_code == 200
            assert http.get("/v1/turns/m-1", headers=b).json()["status"] == "complete"
            assert http.get("/v1/turns/m-1", headers=a).json()["status"] != "cancelled"
            assert http.post("/v1/ui/chat/shared/stop", headers=a).status_code == 200
            deadline = time.monotonic() + 10
            while http.get("/v1/turns/m-1", headers=a).json()["status"] != "cancelled":
                assert time.monotonic() < deadline, "the stop did not reach the turn"
                time.sleep(0.02)


def test_tool_approvals_in_the_ai_sdk_chat_against_a_live_broker(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    """A server tool that waits for a person: approved, denied, and answered after a reload."""
    _node()  # skipped before anything starts when Node or the packages are missing
    payments = ToolEndpoint("/pay", lambda n: {"payment_id": f"pay_{n}"})
    try:
        tools = tmp_path / "tools.json"
        tool = {
            "name": "send_payment",
            "class": "unkeyed_write",
            "endpoint": payments.url,
            "timeout_s": 5,
            "approval": "always",
        }
        tools.write_text(json.dumps({"tools": [tool]}))
        run_node_tests(broker_factory(tools=str(tools)), "approvals.test.mjs", 3)
        assert len(payments.requests) == 2, "approved twice, denied once: two payments"
    finally:
        payments.close()


def test_a_message_with_two_approval_requests_shows_both_before_it_pauses(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    """Regression: a read that caught up between the two requests of one message ended at the
    park with the first only (the attempt parks after the last request is stored)."""
    payments = ToolEndpoint("/pay", lambda n: {"payment_id": f"pay_{n}"})
    try:
        tools = tmp_path / "tools.json"
        tool = {
            "name": "send_payment",
            "class": "unkeyed_write",
            "endpoint": payments.url,
            "timeout_s": 5,
            "approval": "always",
        }
        tools.write_text(json.dumps({"tools": [tool]}))
        broker = broker_factory(tools=str(tools))
        calls = [
            {"name": "send_payment", "args": {"to": "bob", "amount": 1}, "after": 3},
            {"name": "send_payment", "args": {"to": "carol", "amount": 2}, "after": 3},
        ]
        simulate = {"seed": 1, "tokens": 8, "tokens_per_s": 0, "tool_calls": calls}
        body = _chat("two-asks", "m-two", params={"simulate": simulate})
        with httpx.Client(base_url=broker.base_url, timeout=30) as http:
            response = http.post("/v1/ui/chat", json=body)
        assert response.status_code == 200
        chunks = [
            json.loads(line.removeprefix("data: "))
            for line in response.text.splitlines()
            if line.startswith("data: {")
        ]
        asked = [c for c in chunks if c["type"] == "tool-approval-request"]
        assert len(asked) == 2
        assert chunks[-1]["type"] == "finish"
        assert payments.requests == []
    finally:
        payments.close()
