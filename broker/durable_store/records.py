"""What the Durable Streams service takes and gives: requests, a stream's metadata, a read."""

from __future__ import annotations

import dataclasses
from typing import Final

from broker.durable_store import protocol
from broker.errors import Conflict
from broker.frames import ORIGIN, Cursor

CLOSE: Final = b"close"  # the kind of the entry that closes a stream, as Redis sends it
MESSAGE: Final = "m"  # the kind of an append's entry
META_FIELDS: Final = [
    "ctr", "tail", "closed", "inc", "ttl", "exp", "exp_text", "deleted", "fc"
]  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Meta:
    """What a stream's metadata hash says."""

    content_type: str  # as its creator wrote it
    tail: Cursor  # right after the last append (ORIGIN: none yet)
    closed: bool
    incarnation: str
    ttl_s: int | None
    expires_at: str | None  # as its creator wrote it
    expires_ms: int | None
    deleted: bool  # deleted while forks of it live: its path answers 410
    # A fork's chain: each stream it reads from, nearest first, as its digest and the last entry
    # id it reads there (empty for a stream of its own, or a fork made by copy).
    chain: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, fields: list[str | None]) -> Meta | None:
        """The metadata of ``HMGET meta META_FIELDS`` (None: no such stream)."""
        content_type, tail, closed, incarnation, ttl, expires, expires_text, deleted, chain = fields
        if content_type is None:
            return None
        links = chain.split() if chain else []
        return cls(
            content_type,
            Cursor.after(tail) if tail else ORIGIN,
            closed == "1",
            incarnation or "",
            int(ttl) if ttl else None,
            expires_text or None,
            int(expires) if expires else None,
            deleted == "1",
            tuple(zip(links[::2], links[1::2], strict=True)),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Read:
    """What one read found past its cursor."""

    meta: Meta
    # Each append's bytes, in order, and its entry id as Redis sent it (the place right after
    # it): kept apart and raw, so a catch-up read that needs only the bytes pays nothing per
    # append for places it does not use.
    payloads: list[bytes]
    ids: list[bytes]
    after: Cursor  # where the next read starts: right after the last item here
    up_to_date: bool  # nothing is stored past ``after`` (yet)
    closed: bool  # the stream is closed and ``after`` is its end

    @property
    def items(self) -> list[tuple[Cursor, bytes]]:
        """Each append's place (right after it) and bytes, in order."""
        places = [Cursor.after(entry_id.decode()) for entry_id in self.ids]
        return list(zip(places, self.payloads, strict=True))

    @property
    def offsets(self) -> list[str]:
        """Each append's protocol offset (the place right after it), in order."""
        return [protocol.offset_of_id(entry_id) for entry_id in self.ids]

    @property
    def waits(self) -> bool:
        """Whether a long poll waits for more: nothing new, and the stream still open."""
        return not self.payloads and not self.closed


@dataclasses.dataclass(frozen=True, slots=True)
class ForkRequest:
    """A PUT's ``Stream-Forked-From`` (the source's path, checked), ``Stream-Fork-Offset`` (as
    given: None for the source's tail) and ``Stream-Fork-Sub-Offset`` (0: none)."""

    source: str
    offset: str | None = None
    sub: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class CreateRequest:
    """A PUT, its headers parsed: ``content_type`` as the client wrote it (stripped; "" for
    none), the lifetime (a TTL or an expiry, not both), closure, body and fork."""

    content_type: str = ""
    ttl_s: int | None = None
    expires_ms: int | None = None
    expires_at: str | None = None  # as the client wrote it
    closed: bool = False
    body: bytes = b""
    fork: ForkRequest | None = None

    def made_from(self, source: Meta | None) -> CreateRequest:
        """This request as its stream is made, a fork's from its ``source``: the content type
        as written (a media type, else the source's, else the default) and the lifetime (the
        source's, when none is given); 409 when a fork's type is not its source's."""
        raw_type = self.content_type if protocol.media_type(self.content_type) else ""
        lifetime = (self.ttl_s, self.expires_ms, self.expires_at)
        if source is not None:
            ours, theirs = protocol.media_type(raw_type), protocol.media_type(source.content_type)
            if raw_type and ours != theirs:
                raise Conflict(
                    f"a fork's content type is its source's ({source.content_type})",
                    code="type_mismatch",
                )
            raw_type = raw_type or source.content_type
            if self.ttl_s is None and self.expires_ms is None:
                lifetime = (source.ttl_s, source.expires_ms, source.expires_at)
        ttl_s, expires_ms, expires_at = lifetime
        return dataclasses.replace(
            self,
            content_type=raw_type or protocol.DEFAULT_TYPE,
            ttl_s=ttl_s,
            expires_ms=expires_ms,
            expires_at=expires_at.strip() if expires_at else None,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class AppendRequest:
    """A POST, its headers parsed: ``content_type`` as the client wrote it (None: absent)."""

    content_type: str | None = None
    body: bytes = b""
    close: bool = False
    producer: tuple[str, int, int] | None = None  # id, epoch, seq
    stream_seq: str | None = None
