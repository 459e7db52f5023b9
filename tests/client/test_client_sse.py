"""Tests for the pure SSE decoder in broker_client.sse."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker_client import ServerSentEvent, SSEDecoder, decode_all

WIRE_EXAMPLE = (
    "retry: 1000\n"
    "\n"
    "id: 0001764512345678-0000000000\n"
    "event: attempt\n"
    'data: {"attempt":1,"strategy":"initial"}\n'
    "\n"
    "id: 0001764512345679-0000000000\n"
    "event: delta\n"
    'data: {"attempt":1,"text":"Hello"}\n'
    "\n"
    ": ping\n"
    "\n"
    "id: 0001764512345680-0000000000\n"
    "event: end\n"
    'data: {"attempt":1,"status":"complete","reason":null}\n'
    "\n"
)

WIRE_EVENTS = [
    ServerSentEvent(
        data='{"attempt":1,"strategy":"initial"}',
        event="attempt",
        id="0001764512345678-0000000000",
    ),
    ServerSentEvent(
        data='{"attempt":1,"text":"Hello"}', event="delta", id="0001764512345679-0000000000"
    ),
    ServerSentEvent(
        data='{"attempt":1,"status":"complete","reason":null}',
        event="end",
        id="0001764512345680-0000000000",
    ),
]


def feed_each(decoder: SSEDecoder, chunks: list[bytes]) -> list[ServerSentEvent]:
    events: list[ServerSentEvent] = []
    for chunk in chunks:
        events.extend(decoder.feed(chunk))
    return events


def test_wire_example_decodes_to_three_events() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(WIRE_EXAMPLE.encode()) == WIRE_EVENTS
    assert decoder.retry == 1000
    assert decoder.comments == 1
    assert decoder.last_event_id == "0001764512345680-0000000000"
    assert not decoder.pending


def test_every_single_split_point_gives_the_same_events() -> None:
    data = WIRE_EXAMPLE.replace("\n", "\r\n").encode()
    for cut in range(len(data) + 1):
        decoder = SSEDecoder()
        assert feed_each(decoder, [data[:cut], data[cut:]]) == WIRE_EVENTS, cut
        assert decoder.retry == 1000


def test_byte_by_byte_feed() -> None:
    data = WIRE_EXAMPLE.encode()
    assert decode_all([data[i : i + 1] for i in range(len(data))]) == WIRE_EVENTS


@pytest.mark.parametrize("eol", ["\n", "\r", "\r\n"])
def test_line_endings(eol: str) -> None:
    text = eol.join(["event: e", "data: a", "data: b", "", "data: c", "", ""])
    assert decode_all([text]) == [
        ServerSentEvent(data="a\nb", event="e"),
        ServerSentEvent(data="c"),
    ]


def test_cr_and_lf_in_separate_chunks_are_one_line_break() -> None:
    # Treated as two breaks, the LF would be a blank line dispatching "a" on its own.
    assert decode_all(["data: a\r", "\ndata: b\r", "\n\r", "\n"]) == [ServerSentEvent(data="a\nb")]


def test_lone_cr_at_chunk_end_followed_by_text() -> None:
    assert decode_all(["data: a\r", "data: b\r", "\r"]) == [ServerSentEvent(data="a\nb")]


def test_empty_chunks_do_not_disturb_a_pending_cr() -> None:
    assert decode_all(["data: a\r", "", b"", "\ndata: b\n\n"]) == [ServerSentEvent(data="a\nb")]


def test_mixed_line_endings_in_one_stream() -> None:
    assert decode_all(["data: 1\rdata: 2\r\ndata: 3\n\r\n"]) == [ServerSentEvent(data="1\n2\n3")]


def test_comments_are_counted_and_reported() -> None:
    seen: list[str] = []
    decoder = SSEDecoder(on_comment=seen.append)
    events = decoder.feed(": ping\n:\n:  two spaces\ndata: x\n: inside\n\n")
    assert events == [ServerSentEvent(data="x")]
    assert decoder.comments == 4
    assert seen == ["ping", "", " two spaces", "inside"]


def test_multiline_data_and_empty_data_lines() -> None:
    events = decode_all(["data: first\ndata:\ndata\ndata: last\n\n"])
    assert events == [ServerSentEvent(data="first\n\n\nlast")]


def test_field_without_colon_is_field_with_empty_value() -> None:
    # "data" alone appends an empty line, so the event is dispatched with empty data.
    assert decode_all(["data\n\n"]) == [ServerSentEvent(data="")]
    assert decode_all(["event\ndata: x\n\n"]) == [ServerSentEvent(data="x", event="message")]


def test_only_one_space_after_colon_is_removed() -> None:
    assert decode_all(["data:  two\ndata:none\n\n"]) == [ServerSentEvent(data=" two\nnone")]


def test_colon_in_value_is_kept() -> None:
    assert decode_all(['data: {"a": "b:c"}\n\n']) == [ServerSentEvent(data='{"a": "b:c"}')]


def test_event_type_resets_after_dispatch() -> None:
    assert decode_all(["event: delta\ndata: 1\n\ndata: 2\n\n"]) == [
        ServerSentEvent(data="1", event="delta"),
        ServerSentEvent(data="2", event="message"),
    ]


def test_unknown_fields_are_ignored() -> None:
    assert decode_all(["foo: bar\ndata: x\nDATA: y\n\n"]) == [ServerSentEvent(data="x")]


def test_id_persists_until_changed_and_can_be_cleared() -> None:
    assert decode_all(["id: 7\ndata: a\n\ndata: b\n\nid\ndata: c\n\n"]) == [
        ServerSentEvent(data="a", id="7"),
        ServerSentEvent(data="b", id="7"),
        ServerSentEvent(data="c", id=""),
    ]


def test_id_containing_nul_is_ignored() -> None:
    decoder = SSEDecoder()
    events = decoder.feed("id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n")
    assert events == [ServerSentEvent(data="a", id="1"), ServerSentEvent(data="b", id="1")]
    assert decoder.last_event_id == "1"


def test_block_without_data_is_not_dispatched_but_updates_last_event_id() -> None:
    decoder = SSEDecoder()
    assert decoder.feed("id: 41\nevent: delta\n\n") == []
    assert decoder.last_event_id == "41"
    # The event type of the undispatched block must not leak into the next event.
    assert decoder.feed("data: x\n\n") == [ServerSentEvent(data="x", id="41")]


def test_last_event_id_is_committed_only_at_the_blank_line() -> None:
    decoder = SSEDecoder()
    decoder.feed("id: 5\ndata: a\n")
    assert decoder.last_event_id == ""
    assert decoder.pending
    decoder.feed("\n")
    assert decoder.last_event_id == "5"
    assert not decoder.pending


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1500", 1500),
        ("0", 0),
        ("007", 7),
        ("15a", None),
        ("-1", None),
        ("1.5", None),
        ("", None),
        (" 10", None),
        ("\u0661\u0662", None),  # Arabic-Indic digits: isdigit() is True, the spec says ASCII only
    ],
)
def test_retry_needs_ascii_digits_only(value: str, expected: int | None) -> None:
    decoder = SSEDecoder()
    events = decoder.feed(f"retry: {value}\ndata: x\n\n")
    assert decoder.retry == expected
    assert events == [ServerSentEvent(data="x", retry=expected)]


def test_invalid_retry_keeps_previous_value() -> None:
    decoder = SSEDecoder()
    decoder.feed("retry: 250\n\nretry: soon\n\n")
    assert decoder.retry == 250


def test_utf8_split_inside_a_character() -> None:
    data = "data: h\u00e9llo \U0001f600 \u4e16\u754c\n\n".encode()
    expected = [ServerSentEvent(data="h\u00e9llo \U0001f600 \u4e16\u754c")]
    for cut_a in range(len(data) + 1):
        for cut_b in range(cut_a, len(data) + 1):
            chunks = [data[:cut_a], data[cut_a:cut_b], data[cut_b:]]
            assert decode_all(chunks) == expected, (cut_a, cut_b)


def test_invalid_utf8_becomes_replacement_character() -> None:
    assert decode_all([b"data: a\xffb\n\n"]) == [ServerSentEvent(data="a\ufffdb")]


def test_leading_bom_is_stripped_once() -> None:
    data = "\ufeffdata: a\n\n".encode()
    assert decode_all([data[:1], data[1:]]) == [ServerSentEvent(data="a")]
    # A second BOM is not at the stream start: it makes the field name unknown.
    assert decode_all(["\ufeff\ufeffdata: a\n\n"]) == []


def test_unterminated_event_is_discarded_at_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed("data: complete\n\nid: 9\ndata: partial\n") == [
        ServerSentEvent(data="complete")
    ]
    decoder.end()
    assert not decoder.pending
    # The id of the discarded block was never committed and must not reappear later.
    assert decoder.feed("data: next\n\n") == [ServerSentEvent(data="next", id="")]


def test_end_keeps_retry_and_last_event_id_for_the_next_connection() -> None:
    decoder = SSEDecoder()
    decoder.feed("retry: 300\nid: 3\ndata: a\n\n")
    decoder.end()
    assert decoder.retry == 300
    assert decoder.last_event_id == "3"
    assert decoder.feed("data: b\n\n") == [ServerSentEvent(data="b", id="3")]


def test_str_and_bytes_chunks_can_be_mixed() -> None:
    assert decode_all(["data: a", b"b\n", "\n"]) == [ServerSentEvent(data="ab")]


# Property: a generated stream decodes to the events it was built from, however it is chunked.

_VALUE = st.text(
    alphabet=st.characters(exclude_characters="\r\n", exclude_categories=["Cs"]),
    max_size=10,
)
_NAME = st.text(
    alphabet=st.characters(exclude_characters="\r\n:", exclude_categories=["Cs"]),
    min_size=1,
    max_size=8,
)


@dataclass(frozen=True)
class _Block:
    event: str | None
    data: list[str]
    id: str | None
    retry: int | None
    comment: str | None


_BLOCK = st.builds(
    _Block,
    event=st.none() | _NAME,
    data=st.lists(_VALUE, max_size=3),
    id=st.none() | _VALUE.filter(lambda v: "\0" not in v),
    retry=st.none() | st.integers(min_value=0, max_value=10**7),
    comment=st.none() | _VALUE,
)


def _serialize(
    blocks: list[_Block], eols: list[str]
) -> tuple[str, list[ServerSentEvent], int, int | None, str]:
    lines: list[str] = []
    expected: list[ServerSentEvent] = []
    last_id = ""
    retry: int | None = None
    comments = 0
    for block in blocks:
        if block.comment is not None:
            lines.append(":" + block.comment)
            comments += 1
        if block.event is not None:
            lines.append("event: " + block.event)
        if block.id is not None:
            lines.append("id: " + block.id)
            last_id = block.id
        if block.retry is not None:
            lines.append(f"retry: {block.retry}")
            retry = block.retry
        lines.extend("data: " + value for value in block.data)
        lines.append("")
        if block.data:
            expected.append(
                ServerSentEvent(
                    data="\n".join(block.data),
                    event=block.event or "message",
                    id=last_id,
                    retry=block.retry,
                )
            )
    out: list[str] = []
    previous = ""
    for index, line in enumerate(lines):
        eol = eols[index % len(eols)]
        # CR then an empty line ended by LF would read as one CRLF, swallowing that blank line.
        if previous == "\r" and not line and eol == "\n":
            eol = "\r"
        out.append(line + eol)
        previous = eol
    return "".join(out), expected, comments, retry, last_id


@given(
    blocks=st.lists(_BLOCK, max_size=6),
    eols=st.lists(st.sampled_from(["\n", "\r", "\r\n"]), min_size=1, max_size=5),
    data=st.data(),
)
def test_any_chunking_of_a_generated_stream_gives_its_events(
    blocks: list[_Block], eols: list[str], data: st.DataObject
) -> None:
    text, expected, comments, retry, last_id = _serialize(blocks, eols)
    raw = text.encode()
    cuts = sorted(data.draw(st.lists(st.integers(min_value=0, max_value=len(raw)), max_size=8)))
    chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    decoder = SSEDecoder()
    assert feed_each(decoder, chunks) == expected
    assert decoder.comments == comments
    assert decoder.retry == retry
    assert decoder.last_event_id == last_id
    assert not decoder.pending
