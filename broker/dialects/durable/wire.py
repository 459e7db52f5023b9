"""The Durable Streams protocol's spelling of things: offsets, headers, bodies and SSE frames.

Offsets of the protocol's own streams are ``<ms:016>_<seq:016>``, the Redis entry id after
which a read starts, zero-padded so that offsets sort as strings (the protocol's only demand of
them, besides never being ``-1`` or ``now``). A generation stream read through the protocol
keeps the broker's own offsets (``<ms:016>-<seq:010>``), which sort too.
"""

from __future__ import annotations

import base64
import datetime
import json
import math
import random
import re
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any, Final

import orjson

from broker.errors import BadRequest
from broker.frames import Cursor

OFFSET: Final = re.compile(r"([0-9]{16})_([0-9]{16})")
TTL: Final = re.compile(r"0|[1-9][0-9]{0,11}")
WHOLE: Final = re.compile(r"[0-9]{1,16}")
MAX_SAFE: Final = 2**53 - 1  # the protocol's bound on producer epochs and sequence numbers
JSON_TYPE: Final = "application/json"
# How deep a JSON body may nest arrays and objects (its outer array included): deep enough for
# any document a person writes, and far from the parsers' and encoders' own recursion limits.
MAX_JSON_DEPTH: Final = 128
_STRINGS: Final = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS: Final = re.compile(rb"[\[\]{}]")
DEFAULT_TYPE: Final = "application/octet-stream"
CURSOR_EPOCH_MS: Final = int(datetime.datetime(2024, 10, 9, tzinfo=datetime.UTC).timestamp() * 1000)
CURSOR_INTERVAL_MS: Final = 20_000

# Response header names, as the protocol spells them.
NEXT_OFFSET: Final = "Stream-Next-Offset"
UP_TO_DATE: Final = "Stream-Up-To-Date"
CLOSED: Final = "Stream-Closed"
CURSOR: Final = "Stream-Cursor"
# What a browser page may send and read (CORS), besides the broker's own.
DS_REQUEST_HEADERS: Final = [
    "If-None-Match",
    "Stream-Seq",
    "Stream-TTL",
    "Stream-Expires-At",
    "Stream-Closed",
    "Producer-Id",
    "Producer-Epoch",
    "Producer-Seq",
]
DS_RESPONSE_HEADERS: Final = [
    NEXT_OFFSET,
    CURSOR,
    UP_TO_DATE,
    CLOSED,
    "Stream-TTL",
    "Stream-Expires-At",
    "Producer-Epoch",
    "Producer-Seq",
    "Producer-Expected-Seq",
    "Producer-Received-Seq",
    "ETag",
    "Location",
    "Stream-SSE-Data-Encoding",
]


def offset_of(cursor: Cursor) -> str:
    """The protocol offset of a place in one of its own streams."""
    ms, _, seq = cursor.entry_id.partition("-")
    return f"{int(ms):016d}_{int(seq):016d}"


def cursor_of(offset: str) -> Cursor:
    """The place an offset of one of the protocol's own streams names; 400 when malformed."""
    match = OFFSET.fullmatch(offset)
    if match is None:
        raise BadRequest(
            f"malformed offset {offset[:64]!r}: expected -1, now, or an offset of this stream",
            code="bad_offset",
        )
    return Cursor.after(f"{int(match.group(1))}-{int(match.group(2))}")


def start_offset(values: Sequence[str], *, live: bool) -> str:
    """The one ``offset`` of a read (``-1`` when there is none); 400 for two, an empty one, or
    none on a live read."""
    if len(values) > 1:
        raise BadRequest("offset may be given once", code="bad_offset")
    if not values:
        if live:
            raise BadRequest(
                "a live read needs an offset (-1, now, or an offset)", code="bad_offset"
            )
        return "-1"
    if not values[0]:
        raise BadRequest("offset must not be empty", code="bad_offset")
    return values[0]


def sub_offset(value: str | None) -> int:
    """``Stream-Fork-Sub-Offset`` (0 when absent); 400 unless a whole number."""
    if value is None:
        return 0
    if not TTL.fullmatch(value.strip()):
        raise BadRequest("Stream-Fork-Sub-Offset must be a whole number", code="bad_fork")
    return int(value)


def source_path(value: str) -> str:
    """A fork source's path within the mount, from ``Stream-Forked-From`` (``/v1/stream/x``,
    ``/ds/v1/stream/x``, or a URL ending so); 400 for anything else."""
    text = value.strip()
    if "://" in text:
        text = "/" + text.split("://", 1)[1].partition("/")[2]
    for prefix in ("/ds/v1/stream/", "/v1/stream/"):
        if text.startswith(prefix) and len(text) > len(prefix):
            return urllib.parse.unquote(text[len(prefix) :])
    raise BadRequest("Stream-Forked-From must be a stream's path (/v1/stream/...)", code="bad_fork")


def quote_path(path: str) -> str:
    """A stream's path as a URL's path (RFC 3986): every character but the unreserved ones, the
    sub-delimiters, ``:``, ``@`` and ``/`` percent-encoded as UTF-8 (``%``, ``?`` and ``#``
    included), so that any path makes an ASCII ``Location``."""
    return urllib.parse.quote(path, safe="/!$&'()*+,;=:@-._~")


def prefix(payload: bytes, count: int, *, json: bool) -> bytes:
    """The first ``count`` bytes of an append (its first ``count`` values, in JSON mode); 400
    when it has fewer."""
    if json:
        # Messages kept passed MAX_JSON_DEPTH: the array around them is one level more.
        values = _loads(b"[" + payload + b"]", MAX_JSON_DEPTH + 1) if payload else []
        if count > len(values):
            raise BadRequest(
                f"the sub-offset {count} passes the append's {len(values)} values",
                code="bad_fork",
            )
        return b",".join(_compact(v) for v in values[:count])
    if count > len(payload):
        raise BadRequest(
            f"the sub-offset {count} passes the append's {len(payload)} bytes", code="bad_fork"
        )
    return payload[:count]


def media_type(value: str | None) -> str:
    """A content type compared as the protocol compares them: its media type, in lower case."""
    return (value or "").split(";", 1)[0].strip().lower()


def is_json(content_type: str) -> bool:
    return media_type(content_type) == JSON_TYPE


def is_text(content_type: str) -> bool:
    """Whether SSE data of this type go as text (else base64)."""
    kind = media_type(content_type)
    return kind.startswith("text/") or kind == JSON_TYPE


def flag(value: str | None) -> bool:
    """Whether a ``Stream-Closed`` header says ``true`` (any other value: absent)."""
    return value is not None and value.strip().lower() == "true"


def ttl_seconds(value: str | None) -> int | None:
    if value is None:
        return None
    if not TTL.fullmatch(value):
        raise BadRequest(
            "Stream-TTL must be a whole number of seconds, without sign or leading zeros",
            code="bad_ttl",
        )
    return int(value)


def expiry_ms(value: str | None) -> int | None:
    """``Stream-Expires-At`` (RFC 3339) in Unix milliseconds; 400 when it is not a time."""
    if value is None:
        return None
    text = value.strip()
    try:
        moment = datetime.datetime.fromisoformat(text.replace("z", "Z"))
    except ValueError:
        raise BadRequest("Stream-Expires-At must be an RFC 3339 time", code="bad_expiry") from None
    if moment.tzinfo is None or "T" not in text.upper():
        raise BadRequest(
            "Stream-Expires-At must be an RFC 3339 time with a zone", code="bad_expiry"
        )
    return math.floor(moment.timestamp() * 1000)


def producer(id_: str | None, epoch: str | None, seq: str | None) -> tuple[str, int, int] | None:
    """The idempotent producer's headers: all three, or none (400 otherwise)."""
    given = [v is not None for v in (id_, epoch, seq)]
    if not any(given):
        return None
    if not all(given):
        raise BadRequest(
            "Producer-Id, Producer-Epoch and Producer-Seq go together", code="bad_producer"
        )
    assert id_ is not None
    assert epoch is not None
    assert seq is not None
    if not id_:
        raise BadRequest("Producer-Id must not be empty", code="bad_producer")
    numbers = []
    for name, raw in (("Producer-Epoch", epoch), ("Producer-Seq", seq)):
        if not WHOLE.fullmatch(raw) or int(raw) > MAX_SAFE:
            raise BadRequest(f"{name} must be a whole number up to 2^53-1", code="bad_producer")
        numbers.append(int(raw))
    return id_, numbers[0], numbers[1]


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_depth(body: bytes, limit: int) -> bool:
    """Whether the JSON text ``body`` nests at most ``limit`` arrays and objects deep (brackets
    inside strings do not count). Cheap when the body has few brackets at all."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return True
    depth = 0
    for bracket in _BRACKETS.finditer(_STRINGS.sub(b"", body)):
        if bracket.group() in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return False
        else:
            depth -= 1
    return True


def _loads(body: bytes, depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON document; 400 when it is not one, or nests deeper than ``depth``."""
    if not json_depth(body, depth):
        raise BadRequest(
            f"the JSON body nests deeper than {MAX_JSON_DEPTH} arrays and objects",
            code="json_too_deep",
        )
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        # orjson refuses integers past 64 bits, which JSON allows: the standard parser takes
        # them (but neither takes NaN or Infinity).
        try:
            return json.loads(body, parse_constant=_strict_constant)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the body is not valid JSON", code="bad_json") from None


def json_messages(body: bytes, *, allow_empty: bool) -> bytes:
    """A JSON append's messages as they are kept: each value compact, joined by commas (an
    array's elements are the messages: one level flattened). 400 for what is not JSON, nests
    deeper than ``MAX_JSON_DEPTH`` (the outer array included), or for ``[]`` where a message is
    needed."""
    value = _loads(body)
    values = value if isinstance(value, list) else [value]
    if not values and not allow_empty:
        raise BadRequest("an empty JSON array appends nothing", code="empty_append")
    return b",".join(_compact(v) for v in values)


def _compact(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer orjson cannot write
        return json.dumps(value, separators=(",", ":")).encode()


def json_body(payloads: Sequence[bytes]) -> bytes:
    """The JSON array of the messages of several appends."""
    return b"[" + b",".join(p for p in payloads if p) + b"]"


def _interval() -> int:
    return (int(time.time() * 1000) - CURSOR_EPOCH_MS) // CURSOR_INTERVAL_MS


def still_cursor(cursor: str) -> str:
    """A live response's cursor later on: its own, or the current interval once past it."""
    return str(max(_interval(), int(cursor)))


def next_cursor(client: str | None) -> str:
    """The ``Stream-Cursor`` of a live response: the current 20 s interval, and always past the
    client's own (so that caches never serve one response round in a loop)."""
    interval = _interval()
    if client is not None and client.isascii() and client.isdigit() and len(client) < 20:
        echoed = int(client)
        if echoed >= interval:
            return str(echoed + max(1, math.ceil(random.randint(1, 3600) / 20)))
    return str(interval)


def sse_event(kind: str, payload: str) -> bytes:
    """One SSE event: every line of ``payload`` its own ``data:`` line (CR, LF and CRLF all end
    a line, so no payload can inject a field)."""
    lines = payload.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    data = "".join(f"data:{line}\n" for line in lines)
    return f"event: {kind}\n{data}\n".encode()


def sse_data(payload: bytes, content_type: str) -> bytes:
    if is_json(content_type):
        return sse_event("data", json_body([payload]).decode())
    if is_text(content_type):
        return sse_event("data", payload.decode("utf-8", "replace"))
    return sse_event("data", base64.b64encode(payload).decode())


def sse_control(next_offset: str, *, cursor: str | None, up_to_date: bool, closed: bool) -> bytes:
    control: dict[str, Any] = {"streamNextOffset": next_offset}
    if closed:
        control["streamClosed"] = True
    else:
        if cursor is not None:
            control["streamCursor"] = cursor
        if up_to_date:
            control["upToDate"] = True
    return sse_event("control", orjson.dumps(control).decode())
