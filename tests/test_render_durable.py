"""The Durable Streams door's renderer of a generation read as a table: the core's events, the
read's "caught up" and heartbeats in, the exact SSE bytes out. No socket, no Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest

from broker.dialects.durable.render import GenerationRenderer
from broker.frames import ORIGIN, Entry
from broker.viewer import REPLACED

TOKEN = "999999999999"  # a Stream-Cursor past the current interval: it stays as it is


def entry(entry_id: str, kind: str, data: str) -> Entry:
    return Entry.from_redis(entry_id, ["e", kind, "d", data])


ATTEMPT = entry("1-0", "attempt", '{"attempt":1,"strategy":"initial"}')
DELTA = entry("1-1", "delta", '{"attempt":1,"text":"Hi"}')
END = entry("2-0", "end", '{"attempt":1,"status":"complete","reason":null}')


def data(e: Entry) -> bytes:
    body = {"id": e.offset, "event": e.kind, "data": orjson.loads(e.data)}
    return b"event: data\ndata:[" + orjson.dumps(body) + b"]\n\n"


def control(offset: str, *, up_to_date: bool = False, closed: bool = False) -> bytes:
    body: dict[str, Any] = {"streamNextOffset": offset}
    if closed:
        body["streamClosed"] = True
    else:
        body["streamCursor"] = TOKEN
        if up_to_date:
            body["upToDate"] = True
    return b"event: control\ndata:" + orjson.dumps(body) + b"\n\n"


Step = Callable[[GenerationRenderer], bytes]


def batch(*entries: Entry, closes: bool = False) -> Step:
    facts = {entries[-1].offset: True} if closes else {}
    return lambda renderer: renderer.render(entries, facts)


def caught_up(renderer: GenerationRenderer) -> bytes:
    return renderer.caught_up()


def heartbeat(renderer: GenerationRenderer) -> bytes:
    return renderer.heartbeat


def closing(renderer: GenerationRenderer) -> bytes:
    return renderer.closing()


O1, O2, O3 = ATTEMPT.offset, DELTA.offset, END.offset


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        (  # a read that has nothing yet says where it stands, up to date
            [caught_up],
            control(ORIGIN.offset, up_to_date=True),
        ),
        (  # a batch at the tail: the last control waits for "caught up" to say so
            [batch(ATTEMPT, DELTA), caught_up],
            data(ATTEMPT) + control(O1) + data(DELTA) + control(O2, up_to_date=True),
        ),
        (  # a page that is not the tail: the next page says so
            [batch(ATTEMPT), batch(DELTA), caught_up],
            data(ATTEMPT) + control(O1) + data(DELTA) + control(O2, up_to_date=True),
        ),
        (  # the end after which the turn is at rest closes the stream
            [batch(ATTEMPT, DELTA), batch(END, closes=True), closing],
            data(ATTEMPT)
            + control(O1)
            + data(DELTA)
            + control(O2)
            + data(END)
            + control(O3, closed=True),
        ),
        (  # an end another attempt follows does not
            [batch(END), caught_up],
            data(END) + control(O3, up_to_date=True),
        ),
        (  # a quiet read says where it stands every heartbeat
            [batch(DELTA), caught_up, heartbeat, caught_up],
            data(DELTA) + control(O2, up_to_date=True) + control(O2, up_to_date=True),
        ),
        (  # a read that ends early (a shutdown, its longest time) sends the control it held
            [batch(DELTA), closing],
            data(DELTA) + control(O2),
        ),
    ],
    ids=["nothing yet", "at the tail", "pages", "closed", "not closed", "quiet", "cut short"],
)
def test_generation_events(steps: list[Step], expected: bytes) -> None:
    renderer = GenerationRenderer(ORIGIN, TOKEN)
    assert b"".join(step(renderer) for step in steps) == expected


def test_a_read_where_nothing_will_follow_opens_closed() -> None:
    renderer = GenerationRenderer(END.cursor, TOKEN, finished=True)
    assert renderer.opening() == control(O3, closed=True)
    assert renderer.caught_up() == renderer.closing() == b""


def test_the_fixed_frames() -> None:
    renderer = GenerationRenderer(ORIGIN, TOKEN)
    assert (renderer.dialect, renderer.raw, renderer.opening()) == ("durable", False, b"")
    assert renderer.replaced == REPLACED
