"""Incremental decoder for the `text/event-stream` format (WHATWG HTML, "Server-sent events").

The decoder does no I/O: feed it chunks as they arrive and it returns the events they complete.
Chunks may be split anywhere, including inside a UTF-8 sequence or between CR and LF.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["SSEDecoder", "ServerSentEvent", "decode_all"]

_EOL = re.compile(r"\r\n|\r|\n")
_ASCII_DIGITS = frozenset("0123456789")


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    """One dispatched event.

    `id` is the stream's last event ID at dispatch time, as the spec defines it: a block without an
    `id` field inherits the previous one. `retry` is the reconnection time in milliseconds if this
    block carried a valid `retry` field, else None; the decoder's `retry` attribute keeps the latest
    value even from blocks that were not dispatched.
    """

    data: str
    event: str = "message"
    id: str = ""
    retry: int | None = None


class SSEDecoder:
    """Turns a byte or text stream into `ServerSentEvent`s, one `feed` call per received chunk.

    State exposed for reconnecting callers: `last_event_id` (updated by every block that ends,
    including blocks with no data, which are not dispatched), `retry` (latest valid reconnection
    time in ms, or None) and `comments` (number of comment lines seen, e.g. heartbeats).
    `on_comment` is called with each comment's text, minus the colon and one leading space.
    """

    def __init__(self, *, on_comment: Callable[[str], None] | None = None) -> None:
        self.last_event_id = ""
        self.retry: int | None = None
        self.comments = 0
        self._on_comment = on_comment
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._at_start = True
        # A chunk that ends in CR cannot tell yet whether an LF follows; the line is ended at the CR
        # and a leading LF of the next chunk is then swallowed.
        self._skip_lf = False
        self._data: list[str] = []
        self._event_type = ""
        self._id_buffer = ""
        self._block_retry: int | None = None

    def feed(self, chunk: bytes | str) -> list[ServerSentEvent]:
        """Consume one chunk and return the events it completed, possibly none."""
        text = self._utf8.decode(chunk) if isinstance(chunk, bytes) else chunk
        return self._consume(text)

    def end(self) -> None:
        """Signal end of stream: discard any unterminated event, as the spec says, and reset.

        `last_event_id` and `retry` survive, so one decoder can follow a stream across reconnects.
        """
        self._utf8.reset()
        self._buffer = ""
        self._at_start = True
        self._skip_lf = False
        # An id from a block that never ended was never committed.
        self._id_buffer = self.last_event_id
        self._reset_block()

    @property
    def pending(self) -> bool:
        """Whether part of an event has been received but not yet terminated by a blank line."""
        return bool(
            self._buffer
            or self._utf8.getstate()[0]
            or self._data
            or self._event_type
            or self._id_buffer != self.last_event_id
            or self._block_retry is not None
        )

    def _consume(self, text: str) -> list[ServerSentEvent]:
        if not text:
            return []
        if self._at_start:
            self._at_start = False
            if text[0] == "\ufeff":
                text = text[1:]
        if self._skip_lf and text:
            self._skip_lf = False
            if text[0] == "\n":
                text = text[1:]
        buffer = self._buffer + text
        events: list[ServerSentEvent] = []
        pos = 0
        while (match := _EOL.search(buffer, pos)) is not None:
            if match.end() == len(buffer) and match.group() == "\r":
                self._skip_lf = True
            event = self._process_line(buffer[pos : match.start()])
            if event is not None:
                events.append(event)
            pos = match.end()
        self._buffer = buffer[pos:]
        return events

    def _process_line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line[0] == ":":
            self.comments += 1
            if self._on_comment is not None:
                comment = line[1:]
                self._on_comment(comment[1:] if comment.startswith(" ") else comment)
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event_type = value
        elif name == "id":
            if "\0" not in value:
                self._id_buffer = value
        elif name == "retry" and value and set(value) <= _ASCII_DIGITS:
            # str.isdigit() would also accept non-ASCII digits, which the spec rejects.
            self.retry = int(value)
            self._block_retry = self.retry
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        self.last_event_id = self._id_buffer
        if not self._data:
            self._reset_block()
            return None
        event = ServerSentEvent(
            data="\n".join(self._data),
            event=self._event_type or "message",
            id=self.last_event_id,
            retry=self._block_retry,
        )
        self._reset_block()
        return event

    def _reset_block(self) -> None:
        self._data = []
        self._event_type = ""
        self._block_retry = None


def decode_all(chunks: Iterable[bytes | str]) -> list[ServerSentEvent]:
    """Decode a complete stream given as chunks; handy for tests and recorded streams."""
    decoder = SSEDecoder()
    events: list[ServerSentEvent] = []
    for chunk in chunks:
        events.extend(decoder.feed(chunk))
    return events
