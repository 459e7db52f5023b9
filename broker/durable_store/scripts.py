"""The ``ds_*`` scripts of ``broker/lua/``, one typed method each.

As :mod:`broker.scripts` does for the turns' scripts: each method takes the script header's
KEYS (a stream's :class:`~broker.durable_store.keys.StreamKeys`) and ARGV by name, calls the
script through the process's :class:`~broker.scripts.Scripts` (which loads every script at
start, sends EVALSHA, and waits for replicas when asked), and returns its reply decoded by
:mod:`broker.durable_store.replies`.
"""

from __future__ import annotations

import dataclasses

from broker.durable_store.keys import StreamKeys
from broker.durable_store.replies import (
    AppendReply,
    CreateReply,
    DeleteReply,
    ForkRefReply,
    decode_append,
    decode_create,
    decode_delete,
    decode_fork_ref,
)
from broker.scripts import Scripts


@dataclasses.dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's Durable Streams limits, as ``ds_create`` and ``ds_append`` take them (0: no
    limit)."""

    max_streams: int
    max_bytes: int
    appends_per_s: float
    append_burst: int

    @property
    def args(self) -> tuple[int, int, str, int]:
        """ARGV: max streams, max bytes, rate, burst (``ds_append`` takes the last three)."""
        return (self.max_streams, self.max_bytes, repr(self.appends_per_s), self.append_burst)


@dataclasses.dataclass(frozen=True, slots=True)
class Fork:
    """A fork's signature as ``ds_create`` keeps it: its source, the offset as given (an entry
    id, "" for none), as resolved, and the sub-offset ("" for none)."""

    source: str = ""
    given: str = ""
    resolved: str = ""
    sub: str = ""

    @property
    def args(self) -> tuple[str, str, str, str]:
        return (self.source, self.given, self.resolved, self.sub)


NO_FORK = Fork()


class StreamScripts:
    """The ``ds_*`` scripts, typed."""

    def __init__(self, scripts: Scripts) -> None:
        self._scripts = scripts

    async def create(
        self,
        keys: StreamKeys,
        source: StreamKeys,
        *,
        content_type: str,
        ttl_s: int | None,
        expires_ms: int | None,
        expires_at: str | None,
        closed: bool,
        body: bytes,
        incarnation: str,
        raw_content_type: str,
        quota: Quota,
        fork: Fork = NO_FORK,
        part: bytes = b"",
    ) -> CreateReply:
        """``source``: a fork's source's keys (the stream's own for no fork); ``part``: the
        sub-offset's part of the source's next append."""
        args: list[str | bytes] = [
            keys.path,
            content_type,
            "" if ttl_s is None else str(ttl_s),
            "" if expires_ms is None else str(expires_ms),
            expires_at or "",
            "1" if closed else "",
            body,
        ]
        more = [
            incarnation,
            raw_content_type,
            *fork.args,
            part,
            keys.member,
            source.member if fork.source else "",
            *quota.args,
        ]
        refs = [source.meta, source.data, source.forks]
        reply = await self._scripts(
            "ds_create", [*keys.with_forks, *refs, *keys.accounts, *keys.subs], [*args, *more]
        )
        return decode_create(reply)

    async def append(
        self,
        keys: StreamKeys,
        *,
        content_type: str,
        body: bytes,
        close: bool,
        producer: tuple[str, int, int] | None,
        stream_seq: str,
        max_entries: int,
        quota: Quota,
    ) -> AppendReply:
        ident, epoch, seq = producer if producer is not None else ("", 0, 0)
        args = [content_type, body, "1" if close else "", ident, epoch, seq, stream_seq]
        more = [max_entries, keys.member, *quota.args[1:], keys.path]
        reply = await self._scripts(
            "ds_append", [*keys.all, *keys.accounts, *keys.subs], [*args, *more]
        )
        return decode_append(reply)

    async def delete(self, keys: StreamKeys) -> DeleteReply:
        reply = await self._scripts("ds_delete", [*keys.with_forks, *keys.accounts], [keys.member])
        return decode_delete(reply)

    async def fork_ref(self, source: StreamKeys, fork: str) -> ForkRefReply:
        """Give ``fork``'s (a path; a fork made by copy) reference on ``source`` back."""
        refs = [source.meta, source.forks, source.data, source.producers, *source.accounts]
        reply = await self._scripts("ds_fork_ref", refs, [fork, source.member])
        return decode_fork_ref(reply)

    async def touch(self, keys: StreamKeys, ttl_s: int) -> bool:
        """Whether the stream's sliding TTL started again (False: it is gone or deleted)."""
        reply = await self._scripts(
            "ds_touch", [*keys.all, keys.streams], [ttl_s * 1000, keys.member]
        )
        return bool(reply)
