"""The replies of the ``ds_*`` scripts, one frozen type per result word, decoded in one place.

Each script's header (``broker/lua/ds_*.lua``) lists its result words and the values that come
with each; the decoders here are the only code that knows their positions. A word a script does
not answer is a broker error (500), never a guess.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from broker.errors import BrokerError
from broker.frames import Cursor

# --- what more than one script answers ----------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class RateRefused:
    """``rate``: the tenant appends faster than its rate; nothing was done."""

    retry_after_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class QuotaRefused:
    """``quota``: no room for one more stream, or for the bytes; nothing was done."""

    which: Literal["streams", "bytes"]
    limit: int


@dataclasses.dataclass(frozen=True, slots=True)
class Missing:
    """``missing``: no such stream."""


@dataclasses.dataclass(frozen=True, slots=True)
class Gone:
    """``gone``: the stream is deleted, its path kept (410) while forks of it live."""


# --- ds_create ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class StreamMade:
    """``created`` or ``exists``: the stream is there, as asked."""

    created: bool  # False: the same stream was there already
    tail: Cursor  # right after its last entry (the origin: none)
    closed: bool
    content_type: str  # as the stream keeps it: as its creator wrote it


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigConflict:
    """``conflict``: a stream is there with another configuration (``what``: content_type,
    ttl, expiry, closed or fork), or a deleted stream's forks still hold the path (deleted)."""

    what: str


@dataclasses.dataclass(frozen=True, slots=True)
class SourceMissing:
    """``source_missing``: a fork's source does not exist."""


@dataclasses.dataclass(frozen=True, slots=True)
class SourceDeleted:
    """``source_deleted``: a fork's source is deleted (its forks still live)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PastTail:
    """``past_tail``: the fork point is past the source's tail."""


@dataclasses.dataclass(frozen=True, slots=True)
class TooDeep:
    """``too_deep``: the fork would read through more than ``max_depth`` streams."""

    max_depth: int


CreateReply = (
    StreamMade
    | ConfigConflict
    | RateRefused
    | QuotaRefused
    | SourceMissing
    | SourceDeleted
    | PastTail
    | TooDeep
)

# --- ds_append ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Appended:
    """``ok``: appended, closed, or both."""

    tail: Cursor
    closed: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Duplicate:
    """``duplicate``: the producer sent this batch already; ``seq`` is the highest it had
    accepted."""

    tail: Cursor
    seq: int
    closed: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ClosedAgain:
    """``closed_again``: a close of a closed stream (idempotent)."""

    tail: Cursor


@dataclasses.dataclass(frozen=True, slots=True)
class Closed:
    """``closed``: the stream is closed; this append is refused."""

    tail: Cursor


@dataclasses.dataclass(frozen=True, slots=True)
class TypeMismatch:
    """``content_type``: the request's content type is not the stream's."""

    content_type: str


@dataclasses.dataclass(frozen=True, slots=True)
class StaleProducer:
    """``stale_epoch``: a newer epoch of the producer writes now (this one is fenced)."""

    epoch: int


@dataclasses.dataclass(frozen=True, slots=True)
class EpochNotAtZero:
    """``epoch_seq``: a new producer epoch must start at sequence number 0."""


@dataclasses.dataclass(frozen=True, slots=True)
class SequenceGap:
    """``gap``: the producer skipped sequence numbers."""

    expected: int
    received: int


@dataclasses.dataclass(frozen=True, slots=True)
class StreamSeqBehind:
    """``stream_seq``: Stream-Seq does not sort after the last one (``last``)."""

    last: str


@dataclasses.dataclass(frozen=True, slots=True)
class Full:
    """``full``: the stream holds its most appends (``BROKER_DS_MAX_APPENDS``)."""

    max_appends: int


AppendDone = Appended | Duplicate | ClosedAgain
AppendReply = (
    AppendDone
    | Missing
    | Gone
    | Closed
    | TypeMismatch
    | StaleProducer
    | EpochNotAtZero
    | SequenceGap
    | StreamSeqBehind
    | Full
    | RateRefused
    | QuotaRefused
)

# --- ds_delete and ds_fork_ref ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SoftDeleted:
    """``soft``: marked deleted, its path kept while forks of it live."""


@dataclasses.dataclass(frozen=True, slots=True)
class Removed:
    """``deleted``: the stream went; ``source`` is the path of the stream it forked by copy
    (before forks read by reference), whose reference the caller gives back ("" for none)."""

    source: str


@dataclasses.dataclass(frozen=True, slots=True)
class Kept:
    """``kept`` (``ds_fork_ref``): the source stays."""


DeleteReply = Missing | Gone | SoftDeleted | Removed
ForkRefReply = Kept | Removed

# --- decoders -----------------------------------------------------------------------------------


def _words(reply: Sequence[Any]) -> tuple[str, list[str]]:
    return str(reply[0]), ["" if value is None else str(value) for value in reply[1:]]


def _value(values: list[str], index: int) -> str:
    return values[index] if index < len(values) else ""


def _unexpected(script: str, word: str) -> BrokerError:
    return BrokerError(f"unexpected reply {word!r} of {script}")


def _refusal(word: str, values: list[str]) -> RateRefused | QuotaRefused | None:
    """The quota's refusals, which ``ds_create`` and ``ds_append`` both answer."""
    if word == "rate":
        return RateRefused(int(values[0]))
    if word == "quota" and _value(values, 0) in ("streams", "bytes"):
        which: Literal["streams", "bytes"] = "streams" if values[0] == "streams" else "bytes"
        return QuotaRefused(which, int(values[1]))
    return None


def decode_create(reply: Sequence[Any]) -> CreateReply:
    word, values = _words(reply)
    if word in ("created", "exists"):
        tail = Cursor.after(values[0])
        return StreamMade(word == "created", tail, values[1] == "1", _value(values, 2))
    simple: dict[str, CreateReply] = {
        "source_missing": SourceMissing(),
        "source_deleted": SourceDeleted(),
        "past_tail": PastTail(),
    }
    if word in simple:
        return simple[word]
    if word == "conflict":
        return ConfigConflict(_value(values, 0))
    if word == "too_deep":
        return TooDeep(int(values[0]))
    refused = _refusal(word, values)
    if refused is None:
        raise _unexpected("ds_create", word)
    return refused


def decode_append(reply: Sequence[Any]) -> AppendReply:
    word, values = _words(reply)
    value = _value(values, 0)
    if word == "ok":
        return Appended(Cursor.after(value), values[1] == "1")
    if word == "duplicate":
        return Duplicate(Cursor.after(value), int(values[1]), values[2] == "1")
    if word == "closed_again":
        return ClosedAgain(Cursor.after(value))
    if word == "closed":
        return Closed(Cursor.after(value))
    simple: dict[str, AppendReply] = {
        "missing": Missing(),
        "gone": Gone(),
        "epoch_seq": EpochNotAtZero(),
    }
    if word in simple:
        return simple[word]
    if word == "content_type":
        return TypeMismatch(value)
    if word == "stale_epoch":
        return StaleProducer(int(value))
    if word == "gap":
        return SequenceGap(int(value), int(values[1]))
    if word == "stream_seq":
        return StreamSeqBehind(value)
    if word == "full":
        return Full(int(value))
    refused = _refusal(word, values)
    if refused is None:
        raise _unexpected("ds_append", word)
    return refused


def decode_appends(reply: Sequence[Any]) -> list[AppendReply]:
    """``ds_append``'s reply: one reply per append of its group, in their order."""
    return [decode_append(one) for one in reply]


def decode_delete(reply: Sequence[Any]) -> DeleteReply:
    word, values = _words(reply)
    answers: dict[str, DeleteReply] = {"missing": Missing(), "gone": Gone(), "soft": SoftDeleted()}
    if word in answers:
        return answers[word]
    if word == "deleted":
        return Removed(_value(values, 0))
    raise _unexpected("ds_delete", word)


def decode_fork_ref(reply: Sequence[Any]) -> ForkRefReply:
    word, values = _words(reply)
    if word == "kept":
        return Kept()
    if word == "deleted":
        return Removed(_value(values, 0))
    raise _unexpected("ds_fork_ref", word)


ReadState = Literal["tail", "full", "more", "ended", "text"]
READ_STATES: frozenset[str] = frozenset({"tail", "full", "more", "ended", "text"})


@dataclasses.dataclass(frozen=True, slots=True)
class Page:
    """``ds_read``: the stream's metadata (its ``HMGET`` values, decoded; None when not asked),
    the id of the last entry taken ("" for none), the payloads taken, and why it stopped."""

    meta: list[str | None] | None
    last: str
    payloads: list[bytes]
    state: ReadState


def decode_read(reply: Sequence[Any]) -> Page:
    """``ds_read``'s reply, as Redis sent it (undecoded: the payloads are bytes)."""
    meta, last, payloads, state = reply
    word = state.decode()
    if word not in READ_STATES:
        raise _unexpected("ds_read", word)
    fields = [None if value is None else value.decode() for value in meta] if meta else None
    return Page(fields, last.decode(), payloads, word)
