"""The ``ds_*`` scripts of ``broker/lua/``, one typed method each.

As :mod:`broker.scripts` does for the turns' scripts: each method takes the script header's
KEYS (a stream's :class:`~broker.durable_store.keys.StreamKeys`) and ARGV by name, calls the
script through the process's :class:`~broker.scripts.Scripts` (which loads every script at
start, sends EVALSHA, and waits for replicas when asked), and returns its reply decoded by
:mod:`broker.durable_store.replies`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from broker.durable_store.keys import StreamKeys
from broker.durable_store.replies import (
    AppendReply,
    CreateReply,
    DeleteReply,
    ForkRefReply,
    decode_appends,
    decode_create,
    decode_delete,
    decode_fork_ref,
)
from broker.errors import BrokerError
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


@dataclasses.dataclass(frozen=True, slots=True)
class OneAppend:
    """One append of a ``ds_append`` group: its content type ("" for a close alone), body,
    close flag, producer (id, epoch, seq) and Stream-Seq ("" for none)."""

    content_type: str
    body: bytes
    close: bool
    producer: tuple[str, int, int] | None
    stream_seq: str

    @property
    def args(self) -> tuple[str, bytes, str, str, int, int, str]:
        ident, epoch, seq = self.producer if self.producer is not None else ("", 0, 0)
        return (
            self.content_type,
            self.body,
            "1" if self.close else "",
            ident,
            epoch,
            seq,
            self.stream_seq,
        )


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
        self, keys: StreamKeys, appends: Sequence[OneAppend], *, max_entries: int, quota: Quota
    ) -> list[AppendReply]:
        """A group of appends to one stream, in one call: one reply per append, in order."""
        args: list[str | bytes | int] = [max_entries, keys.member, *quota.args[1:], keys.path]
        for one in appends:
            args.extend(one.args)
        reply = await self._scripts("ds_append", [*keys.all, *keys.accounts, *keys.subs], args)
        replies = decode_appends(reply)
        if len(replies) != len(appends):
            raise BrokerError(f"ds_append answered {len(replies)} of {len(appends)} appends")
        return replies

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
