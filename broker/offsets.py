"""Wire offsets: Redis entry ids, zero-padded so that they sort as strings.

An entry id ``<ms>-<seq>`` becomes ``<ms:016>-<seq:010>``. Sixteen digits of milliseconds last
until the year 318857; ten digits of sequence hold more entries than Redis can append in one
millisecond. ``-1`` (from the start) and ``now`` (only new events) are the two sentinels a client
may send; the broker never emits them as event ids.
"""

from __future__ import annotations

import re

from broker.errors import BadRequest

START = "-1"
NOW = "now"
ZERO_ID = "0-0"

# ASCII digits, the whole string: `\d` takes other scripts' digits, and `$` a final newline.
_OFFSET = re.compile(r"([0-9]{16})-([0-9]{10})")
_ENTRY_ID = re.compile(r"([0-9]+)-([0-9]+)")


def from_entry_id(entry_id: str) -> str:
    """Render a Redis entry id as a wire offset."""
    ms, _, seq = entry_id.partition("-")
    return f"{int(ms):016d}-{int(seq):010d}"


def to_entry_id(offset: str) -> str:
    """Parse a wire offset (not a sentinel) into a Redis entry id; 400 when malformed."""
    match = _OFFSET.fullmatch(offset)
    if match is None:
        raise BadRequest(
            f"malformed offset {offset[:64]!r}: expected -1, now, or an event id from this stream",
            code="bad_offset",
        )
    return f"{int(match.group(1))}-{int(match.group(2))}"


def id_key(entry_id: str) -> tuple[int, int]:
    """A sort key for Redis entry ids (which do not sort as strings)."""
    match = _ENTRY_ID.fullmatch(entry_id)
    if match is None:
        raise ValueError(f"not a stream entry id: {entry_id!r}")
    return int(match.group(1)), int(match.group(2))
