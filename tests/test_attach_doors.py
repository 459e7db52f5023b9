"""Attach tokens on every door that reads a generation: the same rules as the native API.

One contract, every door (issue 34, finding 1: a one-viewer token was not enforced on Durable
Streams reads, and the OpenAI and AI SDK doors did not read with attach tokens at all). An
attach token reads its one stream, through any door; a one-viewer token reads over SSE only,
and its newest SSE connection, on whichever door, takes over from the older, which ends with
its door's ``replaced`` signal.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from broker.auth import Principal
from broker.errors import Forbidden
from broker.metrics import Metrics
from broker.viewer import admit
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import bearer, start_turn, wait_final, wait_until

ROOT = Path(__file__).resolve().parents[1]
KEY = "key-acme-0123456789abcdef"
ATTACH_SECRET = "attach-secret-" + "a" * 32


@dataclasses.dataclass(frozen=True)
class Door:
    """How one door reads a generation: its SSE read, its other reads, its signals."""

    name: str
    sse: Callable[[dict[str, Any]], tuple[str, dict[str, str]]]
    # The reads that are not SSE (JSON pages, catch-up, long poll): path and query.
    pages: Callable[[dict[str, Any]], list[tuple[str, dict[str, str]]]]
    is_data: Callable[[str], bool]  # a line of a frame that carries the answer's text
    is_replaced: Callable[[str], bool]  # a line of the door's "replaced" signal
    is_end: Callable[[str], bool]  # a line of the answer's own end
    error_code: Callable[[httpx.Response], str]


def _code(response: httpx.Response) -> str:
    code: str = response.json()["error"]["code"]
    return code  # the native, Durable Streams and OpenAI shapes all keep it there


def _ai_sdk_chunk(line: str) -> dict[str, Any]:
    if not line.startswith("data: {"):
        return {}
    chunk: dict[str, Any] = orjson.loads(line[len("data: ") :])
    return chunk


DOORS = [
    Door(
        "native",
        lambda turn: (f"/v1/streams/{turn['stream_id']}", {}),
        lambda turn: [
            (f"/v1/streams/{turn['stream_id']}", {"format": "json"}),
            (f"/v1/streams/{turn['stream_id']}", {"format": "json", "wait": "2"}),
        ],
        lambda line: line == "event: delta",
        lambda line: line == "event: replaced",
        lambda line: line == "event: end",
        _code,
    ),
    Door(
        "durable_streams",
        lambda turn: (f"/ds/v1/stream/{turn['stream_id']}", {"offset": "-1", "live": "sse"}),
        lambda turn: [
            (f"/ds/v1/stream/{turn['stream_id']}", {"offset": "-1"}),
            (f"/ds/v1/stream/{turn['stream_id']}", {"offset": "now", "live": "long-poll"}),
        ],
        lambda line: line.startswith("data:") and '"event":"delta"' in line,
        lambda line: line == "event: replaced",
        lambda line: '"event":"end"' in line,
        _code,
    ),
    Door(
        "openai_responses",
        lambda turn: (f"/v1/responses/{turn['turn_id']}", {"stream": "true"}),
        lambda turn: [(f"/v1/responses/{turn['turn_id']}", {})],
        lambda line: line == "event: response.output_text.delta",
        lambda line: line.startswith("data: ") and '"code":"viewer_replaced"' in line,
        lambda line: line == "event: response.output_text.done",
        _code,
    ),
    Door(
        "ai_sdk",
        lambda turn: (f"/v1/ui/chat/{turn['conversation_id']}/stream", {}),
        lambda turn: [],  # the AI SDK door reads over SSE only
        lambda line: _ai_sdk_chunk(line).get("type") == "text-delta",
        lambda line: _ai_sdk_chunk(line) == {"type": "error", "errorText": "viewer_replaced"},
        lambda line: line == "data: [DONE]",
        _code,
    ),
]
PAGED = [door for door in DOORS if door.pages({"stream_id": "s", "turn_id": "t"})]


def _secured(factory: BrokerFactory) -> RunningBroker:
    return factory(api_keys=f"acme={KEY}", attach_secret=ATTACH_SECRET)


def _mint(broker: RunningBroker, turn_id: str, **body: Any) -> str:
    response = httpx.post(
        f"{broker.base_url}/v1/turns/{turn_id}/attach-tokens",
        json=body,
        headers=bearer(KEY),
        timeout=10,
    )
    assert response.status_code == 201, response.text
    token: str = response.json()["token"]
    return token


def _long_turn(broker: RunningBroker, conversation_id: str) -> dict[str, Any]:
    turn = start_turn(broker.base_url, conversation_id, auth=KEY, tokens=400, tokens_per_s=40)
    return {**turn, "conversation_id": conversation_id}


def _cancel(broker: RunningBroker, turn: dict[str, Any]) -> None:
    httpx.post(
        f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel", headers=bearer(KEY), timeout=10
    )


def _sse_viewers(broker: RunningBroker) -> float:
    text = httpx.get(f"{broker.base_url}/metrics", timeout=10).text
    lines = [
        x
        for x in text.splitlines()
        if x.startswith("broker_stream_viewers{") and 'mode="sse"}' in x
    ]
    assert lines, "no viewers gauge"
    return sum(float(line.split()[-1]) for line in lines)


@pytest.mark.parametrize("door", PAGED, ids=[door.name for door in PAGED])
def test_a_one_viewer_token_reads_no_page_on_any_door(
    broker_factory: BrokerFactory, door: Door
) -> None:
    """Issue 34, finding 1: a catch-up or long poll of a one-viewer token was answered 200 on
    the Durable Streams door; it takes no lock, so it would read beside the one viewer."""
    broker = _secured(broker_factory)
    turn = _long_turn(broker, "c1")
    token = _mint(broker, turn["turn_id"], one_viewer=True)
    plain = _mint(broker, turn["turn_id"])
    for path, params in door.pages(turn):
        refused = httpx.get(
            f"{broker.base_url}{path}", params=params, headers=bearer(token), timeout=10
        )
        assert refused.status_code == 403, (path, params, refused.text)
        assert door.error_code(refused) == "sse_only"
        # The same read with a token that is not one-viewer is a read like any other.
        if params.get("live") != "long-poll" and "wait" not in params:
            read = httpx.get(
                f"{broker.base_url}{path}", params=params, headers=bearer(plain), timeout=10
            )
            assert read.status_code == 200, (path, params, read.text)
    _cancel(broker, turn)


@pytest.mark.parametrize("door", DOORS, ids=[door.name for door in DOORS])
def test_a_one_viewer_tokens_newest_sse_read_takes_over_on_every_door(
    broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch, door: Door
) -> None:
    """Issue 34, finding 1: two SSE reads of one one-viewer token read side by side on the
    Durable Streams door (and the OpenAI and AI SDK doors read with no attach token)."""
    monkeypatch.setattr("broker.viewer.VIEWER_LEASE_MS", 900)  # renewed every 0.3 s
    broker = _secured(broker_factory)
    turn = _long_turn(broker, "c1")
    token = _mint(broker, turn["turn_id"], one_viewer=True)
    path, params = door.sse(turn)
    url = f"{broker.base_url}{path}"
    reading = threading.Event()
    first_lines: list[str] = []
    first_status: list[int] = []
    first_ended = threading.Event()

    def first_viewer() -> None:
        try:
            with httpx.stream(
                "GET", url, params=params, headers=bearer(token), timeout=20
            ) as response:
                first_status.append(response.status_code)
                for line in response.iter_lines():
                    first_lines.append(line)
                    if door.is_data(line):
                        reading.set()
        finally:
            first_ended.set()  # the server ended it (or refused it)
            reading.set()

    thread = threading.Thread(target=first_viewer, daemon=True)
    thread.start()
    assert reading.wait(10)
    assert first_status == [200], first_lines
    assert not first_ended.is_set(), first_lines[-6:]
    assert wait_until(lambda: _sse_viewers(broker) == 1)
    # A phone back on a new network: its new connection is admitted while the old one lives.
    with httpx.stream("GET", url, params=params, headers=bearer(token), timeout=20) as second:
        assert second.status_code == 200, second.read()
        # (The lines are held: a dropped iterator would close the connection.)
        lines = second.iter_lines()
        assert next(line for line in lines if door.is_data(line))
        # The older connection ends at its next frame, with its door's signal, long before
        # the answer's own end.
        assert first_ended.wait(10), (
            "the older connection went on reading",
            first_lines[-4:],
            _sse_viewers(broker),
        )
        thread.join(10)
        assert any(door.is_replaced(line) for line in first_lines), first_lines[-5:]
        assert not any(door.is_end(line) for line in first_lines)
        assert wait_until(lambda: _sse_viewers(broker) == 1)  # the newer one only
    _cancel(broker, turn)


@pytest.mark.parametrize("door", DOORS, ids=[door.name for door in DOORS])
def test_an_attach_token_reads_its_own_stream_only_on_every_door(
    broker_factory: BrokerFactory, door: Door
) -> None:
    broker = _secured(broker_factory)
    mine = start_turn(broker.base_url, "c1", auth=KEY, tokens=3, tokens_per_s=0)
    mine["conversation_id"] = "c1"
    wait_final(broker.base_url, mine["turn_id"], auth=KEY)
    other = _long_turn(broker, "c2")
    token = _mint(broker, mine["turn_id"])
    path, params = door.sse(other)
    refused = httpx.get(
        f"{broker.base_url}{path}", params=params, headers=bearer(token), timeout=10
    )
    assert refused.status_code == 403, refused.text
    assert door.error_code(refused) == "wrong_stream"
    if door.name != "ai_sdk":  # a resume of a chat at rest is a 204: nothing runs
        path, params = door.sse(mine)
        with httpx.stream(
            "GET", f"{broker.base_url}{path}", params=params, headers=bearer(token), timeout=10
        ) as read:
            assert read.status_code == 200
            assert any(door.is_end(line) for line in read.iter_lines())
    _cancel(broker, other)


OPEN = Principal(kind="open", tenant=None)
KEYED = Principal(kind="api_key", tenant="acme")
SHARED = Principal(kind="attach", tenant="acme", stream_id="st_a", token_id="t1")
ONE_VIEWER = dataclasses.replace(SHARED, one_viewer=True)


@pytest.mark.parametrize(
    ("principal", "stream_id", "sse", "refusal"),
    [
        (OPEN, "st_a", False, None),
        (KEYED, "st_b", False, None),
        (SHARED, "st_a", False, None),
        (SHARED, "st_a", True, None),
        (SHARED, "st_b", True, "wrong_stream"),
        (ONE_VIEWER, "st_a", True, None),
        (ONE_VIEWER, "st_a", False, "sse_only"),
        (ONE_VIEWER, "st_b", True, "wrong_stream"),
        (ONE_VIEWER, "st_b", False, "wrong_stream"),  # the stream is checked first
    ],
)
def test_the_token_rules_of_a_read(
    principal: Principal, stream_id: str, sse: bool, refusal: str | None
) -> None:
    metrics = Metrics()
    if refusal is None:
        admit(metrics, principal, stream_id, sse=sse)
        return
    with pytest.raises(Forbidden) as refused:
        admit(metrics, principal, stream_id, sse=sse)
    assert refused.value.code == refusal


def test_every_door_that_streams_reads_through_the_relay() -> None:
    """A door answers an event stream of a generation through the relay, which wraps it with
    ``as_viewer``, where the token rules live: a door cannot forget them. (Durable Streams
    builds event streams of its own streams too, which are no generation.)"""
    package = ROOT / "broker"
    texts = {
        path.relative_to(package).as_posix(): path.read_text("utf-8")
        for path in sorted(package.rglob("*.py"))
    }
    building = {name for name, text in texts.items() if "EventStreamResponse(" in text}
    assert building == {"sse.py", "relay.py", "dialects/durable/routes.py"}
    viewing = {name for name, text in texts.items() if "as_viewer(" in text}
    assert viewing == {"viewer.py", "relay.py"}
    relayed = {name for name, text in texts.items() if "relay(" in text}
    # Native, OpenAI Responses and Chat Completions, AI SDK, Durable Streams.
    assert {
        "api/native.py",
        "dialects/openai/stored.py",
        "dialects/openai/chat.py",
        "dialects/aisdk/routes.py",
        "dialects/durable/routes.py",
    } <= relayed


def test_the_openai_sdk_sees_a_replaced_read_as_an_error_event(
    broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OpenAI door's replaced frame, as the official SDK hands it to its caller."""
    monkeypatch.setattr("broker.viewer.VIEWER_LEASE_MS", 900)  # renewed every 0.3 s
    broker = _secured(broker_factory)
    turn = _long_turn(broker, "c1")
    token = _mint(broker, turn["turn_id"], one_viewer=True)
    client = openai.OpenAI(
        base_url=f"{broker.base_url}/v1", api_key=token, max_retries=0, timeout=20
    )
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.responses.retrieve(turn["turn_id"])
    assert refused.value.code == "sse_only"
    first = client.responses.retrieve(turn["turn_id"], stream=True)
    types = [next(first).type]
    while types[-1] != "response.output_text.delta":
        types.append(next(first).type)
    second = client.responses.retrieve(turn["turn_id"], stream=True)
    later = iter(second)  # held: a dropped iterator would close the connection
    assert next(event for event in later if event.type == "response.output_text.delta")
    last = list(first)[-1]  # the first read ends, with its door's signal
    assert (last.type, getattr(last, "code", None)) == ("error", "viewer_replaced")
    second.close()
    _cancel(broker, turn)
