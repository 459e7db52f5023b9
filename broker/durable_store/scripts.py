"""The ``ds_*`` scripts of ``broker/lua/``, one typed method each.

As :mod:`broker.scripts` does for the turns' scripts: each method takes the script header's
KEYS (a stream's :class:`~broker.durable_store.keys.StreamKeys`) and ARGV by name, calls the
script through the process's :class:`~broker.scripts.Scripts` (which loads every script at
start, sends EVALSHA, and waits for replicas when asked), and returns its reply decoded by
:mod:`broker.durable_store.replies`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Sequence
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from broker import redis_calls as rc
from broker.durable_store.keys import StreamKeys
from broker.durable_store.replies import (
    AppendReply,
    CreateReply,
    DeleteReply,
    ForkRefReply,
    Page,
    decode_appends,
    decode_create,
    decode_delete,
    decode_fork_ref,
    decode_read,
)
from broker.errors import BrokerError
from broker.scripts import Scripts, broker_error


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
        call = _append_call(keys, appends, max_entries, quota)
        return _append_replies(await self._scripts("ds_append", *call), len(appends))

    async def append_many(
        self, groups: Sequence[Group], *, max_entries: int, quota: Quota
    ) -> list[list[AppendReply] | Exception]:
        """Groups of appends to different streams, a ``ds_append`` call each, all in one round
        trip (one pipeline; alone, a group goes as :meth:`append` sends it): each group's
        replies, or the exception its call raised, in order. With replica acks each call goes
        alone, with its own ``WAIT``."""
        calls = [_append_call(keys, appends, max_entries, quota) for keys, appends in groups]
        scripts = self._scripts
        if len(calls) == 1:  # (a lone writer's: no task, no pipeline)
            sent = [await _caught(scripts("ds_append", *calls[0]))]
        elif scripts.replica_acks > 0:
            sent = await asyncio.gather(*(_caught(scripts("ds_append", *call)) for call in calls))
        else:
            sent = await _pipelined(scripts, scripts.registered("ds_append"), calls)
        return [
            reply if isinstance(reply, Exception) else _caught_now(reply, len(appends))
            for reply, (_, appends) in zip(sent, groups, strict=True)
        ]

    async def read(
        self, keys: StreamKeys, after: str, *, max_bytes: int, max_entries: int, meta: bool
    ) -> Page:
        """A catch-up read's payloads past entry ``after`` (and the stream's metadata, with
        ``meta``), their bytes as Redis sent them: one ``ds_read`` call."""
        args = [after, max_bytes, max_entries, "1" if meta else ""]
        script = self._scripts.registered("ds_read")
        redis = self._scripts.redis
        for attempt in (1, 2):  # the second for a server that lost its scripts
            command = ("EVALSHA", script.sha, 2, keys.meta, keys.data, *args)
            try:
                reply = await redis.execute_command(*command, **rc.UNDECODED)  # type: ignore[no-untyped-call]  # untyped in redis-py
            except NoScriptError:
                if attempt == 2:
                    raise
                script.sha = await redis.script_load(script.script)
                continue
            return decode_read(reply)
        raise AssertionError("unreachable")

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


Group = tuple[StreamKeys, Sequence[OneAppend]]  # appends to one stream, in order
Call = tuple[list[str], list[str | bytes | int]]  # a script call's KEYS and ARGV


def _append_call(
    keys: StreamKeys, appends: Sequence[OneAppend], max_entries: int, quota: Quota
) -> Call:
    args: list[str | bytes | int] = [max_entries, keys.member, *quota.args[1:], keys.path]
    for one in appends:
        args.extend(one.args)
    return [*keys.all, *keys.accounts, *keys.subs], args


def _append_replies(reply: Any, count: int) -> list[AppendReply]:
    replies = decode_appends(reply)
    if len(replies) != count:
        raise BrokerError(f"ds_append answered {len(replies)} of {count} appends")
    return replies


def _caught_now(reply: Any, count: int) -> list[AppendReply] | Exception:
    try:
        return _append_replies(reply, count)
    except Exception as exc:
        return exc


async def _caught(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except Exception as exc:
        return exc


async def _pipelined(scripts: Scripts, script: AsyncScript, calls: Sequence[Call]) -> list[Any]:
    """Each call of ``script`` in one pipeline: its reply, or its error as the script's call
    alone raises it; a server that lost its scripts has it loaded, and the calls sent again."""
    replies: list[Any] = [NoScriptError()] * len(calls)
    for attempt in (1, 2):
        todo = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if not todo:
            break
        if attempt == 2:  # (a NOSCRIPT reply ran nothing: sending it again is safe)
            script.sha = await scripts.redis.script_load(script.script)
        async with scripts.redis.pipeline(transaction=False) as pipe:
            for keys, args in (calls[n] for n in todo):
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            sent = await pipe.execute(raise_on_error=False)
        for n, reply in zip(todo, sent, strict=True):
            replies[n] = reply
    return [broker_error(r) if isinstance(r, ResponseError) else r for r in replies]
