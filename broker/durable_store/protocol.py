"""What the Durable Streams protocol says of a stream's name, content and places: pure rules.

A path names a stream within its tenant (up to ``MAX_PATH`` characters, no control characters,
never the protocol's reserved ``__ds``). An offset is ``<ms:016>_<seq:016>``, the Redis entry id
after which a read starts, zero-padded so that offsets sort as strings (the protocol's only
demand of them, besides never being ``-1`` or ``now``). A content type compares by its media
type in lower case; a JSON stream keeps each append's messages as compact values joined by
commas (an array's elements are the messages: one level flattened).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

import orjson

from broker.errors import BadRequest, NotFound
from broker.frames import ORIGIN, Cursor

OFFSET: Final = re.compile(r"([0-9]{16})_([0-9]{16})")
MAX_PATH: Final = 1_024
JSON_TYPE: Final = "application/json"
DEFAULT_TYPE: Final = "application/octet-stream"
# How deep a JSON body may nest arrays and objects (its outer array included): deep enough for
# any document a person writes, and far from the parsers' and encoders' own recursion limits.
MAX_JSON_DEPTH: Final = 128
_STRINGS: Final = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS: Final = re.compile(rb"[\[\]{}]")
# A run of digits that long may be an integer past 64 bits (or a float's digits, or a string's).
_LONG_DIGITS: Final = re.compile(rb"[0-9]{19}")

# The protocol's names of the response headers an error of a stream carries.
NEXT_OFFSET: Final = "Stream-Next-Offset"
CLOSED: Final = "Stream-Closed"


def checked_path(path: str) -> str:
    """``path`` when a stream may have it; 404 otherwise (no stream is ever there)."""
    if not path or len(path) > MAX_PATH or any(ord(c) < 32 or c == "\x7f" for c in path):
        raise NotFound("no such stream")
    if path == "__ds" or path.startswith("__ds/"):
        raise NotFound("the __ds paths are reserved for the protocol's control APIs")
    return path


def offset_of(cursor: Cursor) -> str:
    """The protocol offset of a place in one of its own streams."""
    ms, _, seq = cursor.entry_id.partition("-")
    return f"{int(ms):016d}_{int(seq):016d}"


def offset_of_id(entry_id: bytes) -> str:
    """The protocol offset of the place right after an entry, from its id as Redis sent it."""
    ms, _, seq = entry_id.partition(b"-")
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


def start_cursor(offset: str) -> Cursor | None:
    """Where a read from ``offset`` starts: None for ``now`` (the tail), the origin for ``-1``;
    400 when malformed."""
    if offset == "now":
        return None
    return ORIGIN if offset == "-1" else cursor_of(offset)


def media_type(value: str | None) -> str:
    """A content type compared as the protocol compares them: its media type, in lower case."""
    return (value or "").split(";", 1)[0].strip().lower()


def is_json(content_type: str) -> bool:
    return media_type(content_type) == JSON_TYPE


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


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(body: bytes, depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON document; 400 when it is not one, or nests deeper than ``depth``."""
    if not json_depth(body, depth):
        raise BadRequest(
            f"the JSON body nests deeper than {MAX_JSON_DEPTH} arrays and objects",
            code="json_too_deep",
        )
    try:
        if _LONG_DIGITS.search(body) is None:
            return orjson.loads(body)
        # orjson reads an integer past 64 bits as a float, its value rounded (or refuses it,
        # by release): the standard parser keeps it exact, as JSON allows (neither takes NaN
        # or Infinity).
        return json.loads(body, parse_constant=_strict_constant)
    except (ValueError, UnicodeDecodeError):  # (orjson's JSONDecodeError is a ValueError)
        raise BadRequest("the body is not valid JSON", code="bad_json") from None


def _compact(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer orjson cannot write
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


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


def payload(field: bytes, value: bytes) -> bytes:
    """An append's bytes from its entry's payload field, as Redis sent it: ``b`` holds the
    bytes as they are; ``d`` (a stream written before payloads were bytes) holds the text whose
    code points are the bytes (Latin-1), as UTF-8."""
    return value if field == b"b" else value.decode().encode("latin-1")
