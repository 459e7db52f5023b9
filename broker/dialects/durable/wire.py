"""The Durable Streams protocol's spelling of things on HTTP: headers, bodies and SSE frames.

Offsets of the protocol's own streams (``<ms:016>_<seq:016>``), their content types and JSON
messages are the service's pure rules (:mod:`broker.durable_store.protocol`). A generation
stream read through the protocol keeps the broker's own offsets (``<ms:016>-<seq:010>``), which
sort too.
"""

from __future__ import annotations

import base64
import datetime
import math
import random
import re
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any, Final

import orjson

from broker.durable_store.protocol import CLOSED, JSON_TYPE, NEXT_OFFSET, is_json, media_type
from broker.errors import BadRequest

TTL: Final = re.compile(r"0|[1-9][0-9]{0,11}")
WHOLE: Final = re.compile(r"[0-9]{1,16}")
MAX_SAFE: Final = 2**53 - 1  # the protocol's bound on producer epochs and sequence numbers
CURSOR_EPOCH_MS: Final = int(datetime.datetime(2024, 10, 9, tzinfo=datetime.UTC).timestamp() * 1000)
CURSOR_INTERVAL_MS: Final = 20_000

# Response header names, as the protocol spells them.
UP_TO_DATE: Final = "Stream-Up-To-Date"
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
