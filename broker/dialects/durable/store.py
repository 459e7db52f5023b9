"""Durable Streams streams kept in Redis: four keys per stream, in its tenant's slot, written
only by the ``ds_*`` scripts, read with plain commands, and waited on through the process's feeds.

A stream is a metadata hash (its existence is the stream's), a Redis Stream with one entry per
append (the entry ids are the offsets, spelled ``<ms:016>_<seq:016>`` on the wire, which sort
as strings), a hash of its idempotent producers, and the set of its forks. All of a tenant's
streams share its slot (``{ds:t:<tenant>}``; an open broker's, ``{ds:open}``) with the
tenant's accounting: the streams it holds, their bytes, and its append rate, which the scripts
check and charge atomically with each write. A fork copies the entries it inherits, ids and all,
into a stream of its own, inside Redis (no byte of it passes through the broker), charged to
the tenant; its source counts it in its forks set, so that a source deleted while forks of it
live stays as a marked path (410) until its last fork goes. Closing adds a last ``close`` entry
after the data: the stream's live readers wake on it as on an append, and a read that meets it
knows the stream has ended. A payload is kept as the text whose code points are its bytes
(Latin-1), so that any bytes go through the Redis client's text replies unchanged.

Reads and writes go to the primary (a Durable Streams client reads its own writes); a live read
waits on the stream's feed like an SSE reader of a generation (:mod:`broker.fanout`): waiting
costs no Redis command, however many wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import Final

from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.deps import Deps
from broker.fanout import Hub, HubClosed
from broker.frames import ORIGIN, Cursor
from broker.keys import ds_digest
from broker.scripts import DsQuota, DsReply

CLOSE: Final = "close"  # the kind of the entry that closes a stream
MESSAGE: Final = "m"  # the kind of an append's entry
READ_COUNT: Final = 512  # entries per XRANGE of a read


def to_text(data: bytes) -> str:
    """Bytes as the text Redis keeps (each byte one code point)."""
    return data.decode("latin-1")


def to_bytes(text: str) -> bytes:
    """The bytes :func:`to_text` kept."""
    return text.encode("latin-1")


@dataclasses.dataclass(frozen=True, slots=True)
class StreamKeys:
    """One stream's keys and its tenant's accounting keys, all in the tenant's slot."""

    tenant: str | None
    path: str  # within its tenant
    member: str  # its name in the tenant's accounting (a digest of its path)
    meta: str
    data: str
    producers: str
    forks: str
    streams: str
    sizes: str
    usage: str

    @property
    def all(self) -> tuple[str, str, str]:
        return (self.meta, self.data, self.producers)

    @property
    def with_forks(self) -> tuple[str, str, str, str]:
        return (self.meta, self.data, self.producers, self.forks)

    @property
    def accounts(self) -> tuple[str, str, str]:
        return (self.streams, self.sizes, self.usage)


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

    @classmethod
    def of(cls, fields: list[str | None]) -> Meta | None:
        content_type, tail, closed, incarnation, ttl, expires, expires_text, deleted = fields
        if content_type is None:
            return None
        return cls(
            content_type,
            Cursor.after(tail) if tail else ORIGIN,
            closed == "1",
            incarnation or "",
            int(ttl) if ttl else None,
            expires_text or None,
            int(expires) if expires else None,
            deleted == "1",
        )


META_FIELDS: Final = ["ctr", "tail", "closed", "inc", "ttl", "exp", "exp_text", "deleted"]


@dataclasses.dataclass(frozen=True, slots=True)
class Read:
    """What one read found past its cursor."""

    meta: Meta
    items: list[tuple[Cursor, str]]  # each append's place (right after it) and payload (text,
    # see to_text), in order
    after: Cursor  # where the next read starts: right after the last item here
    up_to_date: bool  # nothing is stored past ``after`` (yet)
    closed: bool  # the stream is closed and ``after`` is its end


class DurableStore:
    """Create, append, close, delete, look at and read Durable Streams streams."""

    def __init__(self, deps: Deps, hub: Hub) -> None:
        self._redis: Redis = deps.redis
        self._scripts = deps.scripts
        self._keys = deps.keys
        self._settings = deps.settings
        self._hub = hub

    def keys(self, tenant: str | None, path: str) -> StreamKeys:
        """The keys of the stream at ``path`` of ``tenant`` (None: an open broker's)."""
        keys = self._keys
        return StreamKeys(
            tenant,
            path,
            ds_digest(path),
            keys.ds_meta(tenant, path),
            keys.ds_data(tenant, path),
            keys.ds_producers(tenant, path),
            keys.ds_forks(tenant, path),
            keys.ds_streams(tenant),
            keys.ds_sizes(tenant),
            keys.ds_usage(tenant),
        )

    @property
    def quota(self) -> DsQuota:
        settings = self._settings
        return DsQuota(
            settings.ds_tenant_max_streams,
            settings.ds_tenant_max_bytes,
            settings.ds_tenant_appends_per_s,
            settings.ds_tenant_append_burst,
        )

    async def create(
        self,
        keys: StreamKeys,
        *,
        content_type: str,
        raw_content_type: str,
        ttl_s: int | None,
        expires_ms: int | None,
        expires_at: str | None,
        closed: bool,
        body: bytes,
        fork: tuple[str, str, str, str] = ("", "", "", ""),
        part: bytes = b"",
    ) -> DsReply:
        """Create the stream (or find the same one), a fork of ``fork``'s source if it names
        one (see ``ds_create``): its inherited appends are copied inside Redis."""
        source = self.keys(keys.tenant, fork[0] or keys.path)
        refs = (source.meta, source.data, source.forks)
        return await self._scripts.ds_create(
            keys=(*keys.with_forks, *refs, *keys.accounts),
            path=keys.path,
            content_type=content_type,
            ttl_s="" if ttl_s is None else str(ttl_s),
            expires_ms="" if expires_ms is None else str(expires_ms),
            expires_at=expires_at or "",
            closed=closed,
            body=to_text(body),
            incarnation=secrets.token_hex(8),
            raw_content_type=raw_content_type,
            member=keys.member,
            quota=self.quota,
            fork=fork,
            part=to_text(part),
            source_member=source.member if fork[0] else "",
        )

    async def append(
        self,
        keys: StreamKeys,
        *,
        content_type: str,
        body: bytes,
        close: bool,
        producer: tuple[str, int, int] | None,
        stream_seq: str | None,
    ) -> DsReply:
        return await self._scripts.ds_append(
            keys=(*keys.all, *keys.accounts),
            content_type=content_type,
            body=to_text(body),
            close=close,
            producer=producer,
            stream_seq=stream_seq or "",
            max_entries=self._settings.ds_max_appends,
            member=keys.member,
            quota=self.quota,
        )

    async def delete(self, keys: StreamKeys) -> str:
        """Delete a stream (``deleted``), or mark it so while forks of it live (``soft``);
        ``missing`` or ``gone`` (marked already). A fork deleted gives its source's reference
        back, and a source deleted before it goes with its last fork, up the chain."""
        for fork in await rc.smembers(self._redis, keys.forks):
            if not await self._redis.exists(self.keys(keys.tenant, fork).meta):
                await self._redis.srem(keys.forks, fork)  # expired: its reference with it
        reply = await self._scripts.ds_delete(
            keys=(*keys.with_forks, *keys.accounts), member=keys.member
        )
        if reply.result == "deleted" and reply.value(0):
            await self.give_back(keys.tenant, reply.value(0), keys.path)
        return reply.result

    async def give_back(self, tenant: str | None, source: str, fork: str) -> None:
        """Give ``fork``'s reference on ``source`` back; a deleted source goes with its last
        fork, and gives its own source's reference back in turn."""
        while source:
            keys = self.keys(tenant, source)
            refs = (keys.meta, keys.forks, keys.data, keys.producers)
            reply = await self._scripts.ds_fork_ref(keys=refs, fork=fork)
            if reply.result != "deleted":
                return
            source, fork = reply.value(0), source

    async def next_append(self, keys: StreamKeys, after: Cursor) -> tuple[str, str] | None:
        """The first append past ``after`` (entry id, payload), if any."""
        page = await rc.xrange_raw(self._redis, keys.data, "(" + after.entry_id, "+", 2)
        for entry_id, raw in page:
            fields = rc.fields_dict(raw)
            if fields.get("e") != CLOSE:
                return entry_id, fields.get("d", "")
        return None

    async def meta(self, keys: StreamKeys) -> Meta | None:
        """The stream's metadata (None: no such stream)."""
        return Meta.of(await rc.hmget(self._redis, keys.meta, META_FIELDS))

    async def read(self, keys: StreamKeys, after: Cursor | None) -> Read | None:
        """The appends past ``after`` (None: the stream's tail), up to about
        ``BROKER_DS_MAX_READ_BYTES``; None when there is no such stream. A read of a stream with
        a TTL starts its countdown again."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.meta, META_FIELDS)
            if after is not None:
                pipe.xrange(keys.data, min="(" + after.entry_id, max="+", count=READ_COUNT)
            replies = await pipe.execute()
        meta = Meta.of(replies[0])
        if meta is None:
            return None
        if meta.ttl_s is not None:
            await self._touch(keys, meta.ttl_s)
        if after is None:  # from the tail: nothing to read, closed if it is
            return Read(meta, [], meta.tail, True, meta.closed)
        return await self._collect(keys, meta, after, replies[1])

    async def _collect(
        self, keys: StreamKeys, meta: Meta, after: Cursor, page: rc.RawEntries
    ) -> Read:
        limit = self._settings.ds_max_read_bytes
        items: list[tuple[Cursor, str]] = []
        size = 0
        cursor = after
        while True:
            for entry_id, raw in page:
                fields = rc.fields_dict(raw)
                if fields.get("e") == CLOSE:
                    return Read(meta, items, cursor, True, True)
                data = fields.get("d", "")
                if items and size + len(data) > limit:
                    return Read(meta, items, cursor, False, False)
                cursor = Cursor.after(entry_id)
                items.append((cursor, data))
                size += len(data)
            if len(page) < READ_COUNT:
                return Read(meta, items, cursor, True, False)
            page = await rc.xrange_raw(
                self._redis, keys.data, "(" + cursor.entry_id, "+", READ_COUNT
            )

    async def _touch(self, keys: StreamKeys, ttl_s: int) -> None:
        await self._scripts.ds_touch(
            keys=(*keys.all, keys.streams), ttl_ms=ttl_s * 1000, member=keys.member
        )

    async def wait(self, keys: StreamKeys, after: Cursor, timeout_s: float) -> None:
        """Return once something may be stored past ``after`` (an append, a close), or after
        ``timeout_s``. Waiting rides the stream's feed: no Redis command per waiting reader."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        subscription = self._hub.subscribe(keys.data, after)
        try:
            if not subscription.covers(after):
                return  # the feed is past this reader already: look in Redis
            subscription.cursor = after
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    return
                batches = await subscription.get_all(left)
                if batches is None:
                    if subscription.overflowed:
                        return
                    continue
                for batch in batches:
                    if any(entry.sort_key > after.key for entry in batch.entries):
                        return
        except HubClosed:
            return
        finally:
            self._hub.unsubscribe(subscription)
