"""One contract, every door: each door's streamed read of a generation keeps the rules the
relay owns (see broker/relay.py), so a rule added later holds on every door or fails here.

| rule | what is checked |
|---|---|
| cut and resume | a read cut after a few events and resumed with the door's cursor assembles the
  stored answer exactly: no gap, no duplicate |
| a stalled reader | a client that stops reading is let go after the send timeout, and its place
  in the viewers gauge (under the door's ``dialect`` label) is freed |
| a stop | the door's stop ends every read with the door's own terminal frame, and the read ends |
| the viewers gauge | a read is counted under its door's label while it lasts, and no longer |

The token rules (an attach token reads its own stream only; a one-viewer token reads over SSE
only, its newest connection taking over) are run over every door that reads with attach tokens
by ``tests/test_attach_doors.py``; ``test_the_token_rules_cover_every_door`` holds the two door
tables together.
"""

from __future__ import annotations

import dataclasses
import itertools
import socket
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx
import orjson
import pytest

from broker.metrics import DIALECTS
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import get_turn, start_turn, wait_final, wait_until
from tests.test_attach_doors import DOORS as ATTACH_DOORS

_ids = itertools.count()


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """One SSE event as a client parses it."""

    id: str | None
    event: str | None
    data: str

    def json(self) -> Any:
        try:
            return orjson.loads(self.data)
        except orjson.JSONDecodeError:
            return None  # such as Chat Completions' [DONE]


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    params: dict[str, str]
    headers: dict[str, str]
    body: dict[str, Any] | None = None


Turn = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Door:
    """How the contract drives one door."""

    name: str
    dialect: str  # the viewers gauge's label
    # Starts a turn (through the door when only the door can) with these simulate knobs.
    start: Callable[[RunningBroker, dict[str, Any]], Turn]
    # The door's streamed read of the turn, from the door's cursor (None: from the start).
    read: Callable[[Turn, str | None], Request]
    text: Callable[[Frame], str]  # the answer's text a frame carries
    cursor: Callable[[Frame], str | None]  # where a read resumes after this frame (None: same)
    stop: Callable[[RunningBroker, Turn], None]  # the door's stop button
    is_stopped: Callable[[Frame], bool]  # the door's terminal frame of a stopped answer


def _native_start(broker: RunningBroker, knobs: dict[str, Any]) -> Turn:
    conversation = f"contract-{next(_ids)}"
    turn = start_turn(broker.base_url, conversation, **knobs)
    return {**turn, "conversation_id": conversation}


def _native_cancel(broker: RunningBroker, turn: Turn) -> None:
    url = f"{broker.base_url}/v1/turns/{turn['turn_id']}/cancel"
    assert httpx.post(url, timeout=10).status_code == 200


def _chat_body(turn: Turn) -> dict[str, Any]:
    return {
        "model": "simulated",
        "messages": [{"role": "user", "content": "Tell me about streams"}],
        "stream": True,
        "broker": {"params": {"simulate": turn["knobs"]}},
    }


def _chat_start(broker: RunningBroker, knobs: dict[str, Any]) -> Turn:
    turn: Turn = {"key": f"contract-chat-{next(_ids)}", "knobs": knobs}
    request = _chat_read(turn, None)
    with httpx.stream(
        "POST",
        f"{broker.base_url}{request.path}",
        json=request.body,
        headers=request.headers,
        timeout=10,
    ) as response:
        assert response.status_code == 200
        turn["turn_id"] = response.headers["x-broker-turn-id"]
        turn["stream_id"] = response.headers["x-broker-stream-id"]
    return turn


def _chat_read(turn: Turn, cursor: str | None) -> Request:
    headers = {"Idempotency-Key": turn["key"]}
    if cursor is not None:
        headers["Last-Event-ID"] = cursor
    return Request("POST", "/v1/chat/completions", {}, headers, _chat_body(turn))


def _chat_text(frame: Frame) -> str:
    chunk = frame.json()
    if not isinstance(chunk, dict) or not chunk.get("choices"):
        return ""
    return str(chunk["choices"][0]["delta"].get("content") or "")


def _ui_chunk(frame: Frame) -> dict[str, Any]:
    chunk = frame.json()
    return chunk if isinstance(chunk, dict) else {}


def _ds_messages(frame: Frame) -> list[dict[str, Any]]:
    return list(frame.json() or []) if frame.event == "data" else []


def _ds_text(frame: Frame) -> str:
    return "".join(
        str(m["data"].get("text", "")) for m in _ds_messages(frame) if m["event"] == "delta"
    )


def _ds_cursor(frame: Frame) -> str | None:
    if frame.event != "control":
        return None
    offset: str = orjson.loads(frame.data)["streamNextOffset"]
    return offset


def _ds_closed(frame: Frame) -> bool:
    return frame.event == "control" and bool(orjson.loads(frame.data).get("streamClosed"))


DOORS = [
    Door(
        "native",
        "native",
        _native_start,
        lambda turn, cursor: Request(
            "GET",
            f"/v1/streams/{turn['stream_id']}",
            {},
            {} if cursor is None else {"Last-Event-ID": cursor},
        ),
        lambda f: str(orjson.loads(f.data)["text"]) if f.event == "delta" else "",
        lambda f: f.id,
        _native_cancel,
        lambda f: f.event == "end" and orjson.loads(f.data)["status"] == "cancelled",
    ),
    Door(
        "openai_responses",
        "responses",
        _native_start,
        lambda turn, cursor: Request(
            "GET",
            f"/v1/responses/{turn['turn_id']}",
            {"stream": "true", **({} if cursor is None else {"starting_after": cursor})},
            {},
        ),
        lambda f: str(f.json()["delta"]) if f.event == "response.output_text.delta" else "",
        lambda f: str(f.json()["sequence_number"]) if f.event else None,
        lambda broker, turn: _ok(
            httpx.post(f"{broker.base_url}/v1/responses/{turn['turn_id']}/cancel", timeout=10)
        ),
        lambda f: (
            f.event == "response.incomplete" and f.json()["response"]["status"] == "cancelled"
        ),
    ),
    Door(
        "openai_chat",
        "chat",
        _chat_start,
        _chat_read,
        _chat_text,
        lambda f: f.id,
        _native_cancel,  # Chat Completions has no stop of its own: the native cancel
        lambda f: f.data == "[DONE]",
    ),
    Door(
        "ai_sdk",
        "aisdk",
        _native_start,
        lambda turn, cursor: Request(
            "GET",
            f"/v1/ui/chat/{turn['conversation_id']}/stream",
            {},
            {} if cursor is None else {"Last-Event-ID": cursor},
        ),
        lambda f: str(_ui_chunk(f)["delta"]) if _ui_chunk(f).get("type") == "text-delta" else "",
        lambda f: f.id,
        lambda broker, turn: _ok(
            httpx.post(f"{broker.base_url}/v1/ui/chat/{turn['conversation_id']}/stop", timeout=10)
        ),
        lambda f: _ui_chunk(f) == {"type": "abort", "reason": "cancelled"},
    ),
    Door(
        "durable_streams",
        "durable",
        _native_start,
        lambda turn, cursor: Request(
            "GET",
            f"/ds/v1/stream/{turn['stream_id']}",
            {"offset": "-1" if cursor is None else cursor, "live": "sse"},
            {},
        ),
        _ds_text,
        _ds_cursor,
        _native_cancel,
        _ds_closed,
    ),
]
IDS = [door.name for door in DOORS]


def _ok(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text


def frames(response: httpx.Response) -> Iterator[Frame]:
    """The SSE events of ``response`` as they arrive (comments skipped)."""
    fields: dict[str, str] = {}
    data: list[str] = []
    for line in response.iter_lines():
        if not line:
            if data:
                yield Frame(fields.get("id"), fields.get("event"), "\n".join(data))
            fields, data = {}, []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            else:
                fields[name] = value


def stream(broker: RunningBroker, request: Request, timeout: float = 20) -> Any:
    return httpx.stream(
        request.method,
        f"{broker.base_url}{request.path}",
        params=request.params,
        headers=request.headers,
        json=request.body,
        timeout=timeout,
    )


def viewers(broker: RunningBroker, door: Door) -> float:
    return broker.metric("broker_stream_viewers", f'{{dialect="{door.dialect}",mode="sse"}}')


def read(
    broker: RunningBroker, door: Door, turn: Turn, cursor: str | None, *, cut_after: int = 0
) -> tuple[str, str | None, bool]:
    """The text of a read from ``cursor``, the cursor it ends at, and whether it was cut (after
    ``cut_after`` frames with text; 0: never)."""
    text: list[str] = []
    with stream(broker, door.read(turn, cursor)) as response:
        assert response.status_code == 200, response.read()
        for frame in frames(response):
            piece = door.text(frame)
            if piece:
                text.append(piece)
            moved = door.cursor(frame)
            cursor = moved or cursor
            # Cut where the door gives a cursor: what came before it is all the client holds.
            if moved and cut_after and len(text) >= cut_after:
                return "".join(text), cursor, True
    return "".join(text), cursor, False


@pytest.mark.parametrize("door", DOORS, ids=IDS)
def test_a_cut_read_resumes_without_gap_or_duplicate(broker: RunningBroker, door: Door) -> None:
    turn = door.start(broker, {"seed": 3, "tokens": 60, "tokens_per_s": 120})
    cursor: str | None = None
    parts: list[str] = []
    cuts = 0
    for _ in range(30):
        text, cursor, cut = read(broker, door, turn, cursor, cut_after=4)
        parts.append(text)
        cuts += cut
        if not cut:
            break
    final = wait_final(broker.base_url, turn["turn_id"])
    assert final["status"] == "complete"
    assert cuts >= 2, "the read was never cut"
    assert "".join(parts) == final["canonical"]["text"]


@pytest.mark.parametrize("door", DOORS, ids=IDS)
def test_a_stop_ends_every_read_with_the_doors_terminal_frame(
    broker: RunningBroker, door: Door
) -> None:
    turn = door.start(broker, {"tokens": 400, "tokens_per_s": 40})
    seen: list[Frame] = []
    with stream(broker, door.read(turn, None)) as response:
        assert response.status_code == 200
        # (Held: a dropped iterator would close the connection.)
        arriving = frames(response)
        for frame in arriving:
            seen.append(frame)
            if door.text(frame):
                break
        assert wait_until(lambda: viewers(broker, door) == 1)
        door.stop(broker, turn)
        seen += arriving  # to the read's end: the door ends it
    assert any(door.is_stopped(frame) for frame in seen), seen[-4:]
    assert get_turn(broker.base_url, turn["turn_id"])["status"] == "cancelled"
    assert wait_until(lambda: viewers(broker, door) == 0)


def _raw_request(broker: RunningBroker, request: Request) -> bytes:
    target = request.path + (f"?{urlencode(request.params)}" if request.params else "")
    lines = [f"{request.method} {target} HTTP/1.1", "Host: broker"]
    lines += [f"{name}: {value}" for name, value in request.headers.items()]
    body = b"" if request.body is None else orjson.dumps(request.body)
    if request.body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize("door", DOORS, ids=IDS)
def test_a_stalled_reader_is_let_go_and_frees_its_place(
    broker_factory: BrokerFactory, door: Door
) -> None:
    broker = broker_factory(sse_send_timeout_s=0.5, max_stream_events=200_000)
    knobs = {"tokens": 100_000, "tokens_per_s": 0}
    turn = (
        {"key": f"contract-chat-{next(_ids)}", "knobs": knobs}
        if door.start is _chat_start
        else door.start(broker, knobs)
    )
    url = urlsplit(broker.base_url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect((url.hostname, url.port))
    try:
        sock.sendall(_raw_request(broker, door.read(turn, None)))
        assert wait_until(lambda: viewers(broker, door) == 1, timeout=10)
        # Never read: the broker's writes back up, and after 0.5 s of that it lets go, long
        # before the answer could be sent.
        assert wait_until(lambda: viewers(broker, door) == 0, timeout=30, interval=0.1)
    finally:
        sock.close()
        if "turn_id" in turn:
            _native_cancel(broker, turn)
        else:
            wait_until(lambda: _chat_turn_id(broker, turn), timeout=10)


def _chat_turn_id(broker: RunningBroker, turn: Turn) -> bool:
    """Cancel the stalled chat's turn (its id is the idempotency key)."""
    url = f"{broker.base_url}/v1/turns/{turn['key']}/cancel"
    return httpx.post(url, timeout=10).status_code == 200


def test_the_contract_runs_every_door() -> None:
    """Every door the viewers gauge knows is driven by this suite: a new door joins it."""
    assert sorted(door.dialect for door in DOORS) == sorted(DIALECTS)


def test_the_token_rules_cover_every_door() -> None:
    """Every door that reads with attach tokens has its token rules run by test_attach_doors;
    Chat Completions reads only through a POST, which an attach token may not make."""
    assert {door.name for door in ATTACH_DOORS} == set(IDS) - {"openai_chat"}
