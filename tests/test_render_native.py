"""The native door's renderer as a table: the core's events in, the exact bytes out."""

from __future__ import annotations

import pytest

from broker.api.native import NativeRenderer
from broker.frames import Entry
from broker.relay import NO_FACTS
from broker.sse import PING
from broker.viewer import REPLACED


def entry(entry_id: str, kind: str, data: str) -> Entry:
    return Entry.from_redis(entry_id, ["e", kind, "d", data])


ATTEMPT = entry("1700000000000-0", "attempt", '{"attempt":1,"strategy":"initial"}')
DELTA = entry("1700000000000-1", "delta", '{"attempt":1,"text":"Hi"}')
END = entry("1700000000001-0", "end", '{"attempt":1,"status":"complete","reason":null}')


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([], b""),
        (
            [ATTEMPT],
            b"id: 0001700000000000-0000000000\nevent: attempt\n"
            b'data: {"attempt":1,"strategy":"initial"}\n\n',
        ),
        (
            [DELTA, END],
            b'id: 0001700000000000-0000000001\nevent: delta\ndata: {"attempt":1,"text":"Hi"}\n\n'
            b"id: 0001700000000001-0000000000\nevent: end\n"
            b'data: {"attempt":1,"status":"complete","reason":null}\n\n',
        ),
    ],
    ids=["nothing", "one event", "a batch"],
)
def test_a_batch_is_the_stored_frames_joined(entries: list[Entry], expected: bytes) -> None:
    assert NativeRenderer(2000).render(entries, NO_FACTS) == expected


@pytest.mark.parametrize(
    ("renderer", "expected"),
    [
        (NativeRenderer(2000), b"retry: 2000\n"),
        (
            NativeRenderer(1500, "0001700000000000-0000000001"),
            b"retry: 1500\nid: 0001700000000000-0000000001\nevent: resume_point\n"
            b'data: {"offset":"0001700000000000-0000000001"}\n\n',
        ),
    ],
    ids=["a read from a named start", "a read from now"],
)
def test_the_opening(renderer: NativeRenderer, expected: bytes) -> None:
    assert renderer.opening() == expected


def test_the_fixed_frames() -> None:
    renderer = NativeRenderer(2000)
    assert (renderer.dialect, renderer.raw) == ("native", True)
    assert renderer.heartbeat == PING == b": ping\n"
    assert renderer.closing() == b""
    assert renderer.replaced == REPLACED
    assert REPLACED.startswith(b"event: replaced\ndata: ")
