"""Durable Streams' own streams: create, append, read, wait for, close, delete and fork them.

A stream is four keys in its tenant's slot (:mod:`broker.durable_store.keys`), written only by
the ``ds_*`` scripts (:mod:`broker.durable_store.scripts`), read with plain commands, and
waited on through the process's feeds. A stream is a metadata hash (its existence is the
stream's), a Redis Stream with one entry per append (the entry ids are the offsets), a hash of
its idempotent producers, and the set of its forks. The tenant's accounting (the streams it
holds, their bytes, its append rate) is checked and charged by the scripts atomically with each
write. A fork copies nothing: it records its source, its fork point and its chain (the streams
it reads from, at most 16), and a read of it reads what it inherits from those streams' data,
then its own; it is charged what it adds. Its reference on its source (the source's forks set,
the tenant's refs hash) pins the source: its data stays while forks read it, through its
deletion (its path answers 410) or its expiry (404), charged to the tenant, and goes with its
last fork, in the script that removes that fork or prunes it once expired
(``broker/lua/_ds_quota.lua``). Closing adds a last ``close`` entry after the data: the
stream's live readers wake on it as on an append, and a read that meets it knows the stream
has ended. A payload is kept as its bytes (the entry's field ``b``; a stream written before
kept text whose code points are its bytes, field ``d``, still read as those bytes), sent to the
scripts as bytes and read back undecoded, and so is waited on (a bare feed: places only).

Reads and writes go to the primary (a Durable Streams client reads its own writes); a live read
waits on the stream's feed like an SSE reader of a generation (:mod:`broker.fanout`): waiting
costs no Redis command, however many wait.

Every method takes the caller's tenant (None: an open broker's) and the stream's path, and
returns what happened as a typed result, or raises the refusal as a :class:`BrokerError`
(:mod:`broker.durable_store.errors`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from redis.asyncio import Redis

from broker import redis_calls as rc
from broker.deps import Deps
from broker.durable_store import errors, protocol
from broker.durable_store.groups import AppendGroups
from broker.durable_store.keys import KeySpace, StreamKeys
from broker.durable_store.records import (
    CLOSE,
    META_FIELDS,
    AppendRequest,
    CreateRequest,
    ForkRequest,
    Meta,
    Read,
)
from broker.durable_store.replies import (
    AppendDone,
    Appended,
    AppendReply,
    Closed,
    ClosedAgain,
    ConfigConflict,
    Duplicate,
    EpochNotAtZero,
    Full,
    Gone,
    Missing,
    Page,
    PastTail,
    QuotaRefused,
    RateRefused,
    Removed,
    SequenceGap,
    SourceDeleted,
    SourceMissing,
    StaleProducer,
    StreamMade,
    StreamSeqBehind,
    TooDeep,
    TypeMismatch,
)
from broker.durable_store.scripts import NO_FORK, Fork, OneAppend, Quota, StreamScripts
from broker.errors import BadRequest, BrokerError, Conflict
from broker.fanout import Hub, HubClosed
from broker.frames import Cursor

READ_COUNT: Final = 512  # entries of a read's first XRANGE
# A read that goes on past a full page asks for twice as many each time, up to this: a long
# catch-up costs few round trips, and no single XRANGE holds Redis for long.
MAX_READ_COUNT: Final = 4096
# The most appends one catch-up read takes in Redis (``ds_read``): a bound on the time it holds
# the server; a read of more answers what it took, not at the tail, and the client reads on.
PAGE_ENTRIES: Final = 16_384
KEYS_KEPT: Final = 4_096  # streams whose keys are kept at once (see DurableStore._keys)

Body = bytes | Callable[[], Awaitable[bytes]]


@dataclasses.dataclass(frozen=True, slots=True)
class _Fork:
    """What a fork is made of: its source's metadata, its signature for an idempotent PUT, and
    the part of the source's next append that a sub-offset takes."""

    source: Meta
    signature: Fork
    part: bytes


_MORE, _FULL, _ENDED = object(), object(), object()  # what taking a page came to


class _Taken:
    """What a read took so far: each append's bytes and entry id, their size, where it stands."""

    def __init__(self, after: Cursor, limit: int) -> None:
        self.payloads: list[bytes] = []
        self.ids: list[bytes] = []
        self.size = 0
        self.cursor = after
        self.limit = limit

    def take(self, page: rc.ByteEntries) -> object:
        """Take ``page``'s entries, from Redis's reply as it is (each ``[id, [b"e", kind,
        field, payload]]``, see the ``ds_*`` scripts; no dict, no place per entry): ``_MORE``
        when all were taken, ``_FULL`` at the byte limit, ``_ENDED`` at the stream's close
        entry. Only the last entry taken becomes a :class:`Cursor`."""
        payloads, ids, size, limit = self.payloads, self.ids, self.size, self.limit
        before = len(ids)
        state = _MORE
        for entry_id, fields in page:
            if fields[1] == CLOSE:
                state = _ENDED
                break
            data = fields[3] if fields[2] == b"b" else protocol.payload(fields[2], fields[3])
            if payloads and size + len(data) > limit:
                state = _FULL
                break
            ids.append(entry_id)
            payloads.append(data)
            size += len(data)
        self.size = size
        if len(ids) > before:
            self.cursor = Cursor.after(ids[-1].decode())
        return state

    def read(self, meta: Meta, *, up_to_date: bool, closed: bool) -> Read:
        return Read(meta, self.payloads, self.ids, self.cursor, up_to_date, closed)


def _paged(meta: Meta, after: Cursor, page: Page) -> Read:
    """A catch-up read from ``ds_read``'s page: its payloads, no places but the last."""
    cursor = Cursor.after(page.last) if page.last else after
    ended = page.state == "ended"
    tail = ended or page.state == "tail"
    return Read(meta, page.payloads, [], cursor, tail, ended)


class DurableStore:
    """Create, append, close, delete, look at, read and wait for Durable Streams streams."""

    def __init__(self, deps: Deps, hub: Hub) -> None:
        self._redis: Redis = deps.redis
        self._scripts = StreamScripts(deps.scripts)
        self._space = KeySpace(deps.keys.prefix)
        self._settings = deps.settings
        self._metrics = deps.metrics
        self._hub = hub
        # Told of each append and creation (whose scripts marked the subscriptions they concern):
        # the process's wake loop looks at once when the tenant has subscriptions.
        self.on_write: Callable[[str | None], None] | None = None
        self._groups = AppendGroups(self._append_groups)
        self._named: dict[tuple[str | None, str], StreamKeys] = {}

    def _keys(self, tenant: str | None, path: str) -> StreamKeys:
        # A writer names its stream on every append: its keys (a digest and eleven names) are
        # kept for the streams named lately, and all forgotten when there are too many.
        keys = self._named.get((tenant, path))
        if keys is None:
            if len(self._named) >= KEYS_KEPT:
                self._named.clear()
            keys = self._named[(tenant, path)] = self._space.of(tenant, path)
        return keys

    @property
    def quota(self) -> Quota:
        settings = self._settings
        return Quota(
            settings.ds_tenant_max_streams,
            settings.ds_tenant_max_bytes,
            settings.ds_tenant_appends_per_s,
            settings.ds_tenant_append_burst,
        )

    # --- writes -------------------------------------------------------------------------------

    async def create(
        self, tenant: str | None, path: str, request: CreateRequest, body: Body = b""
    ) -> StreamMade:
        """Create the stream (or find the same one), a fork if ``request`` names a source (which
        copies nothing, see the module). ``body`` (the bytes, or how to read them) is
        read once the fork is made out. 409 for another configuration."""
        keys = self._keys(tenant, path)
        fork = await self._fork(keys, request.fork) if request.fork is not None else None
        made = request.made_from(fork.source if fork is not None else None)
        content_type = protocol.media_type(made.content_type)
        data = body if isinstance(body, bytes) else await body()
        if data and content_type == protocol.JSON_TYPE:
            data = protocol.json_messages(data, allow_empty=True)
        source_keys = self._keys(tenant, fork.signature.source) if fork is not None else keys
        reply = await self._scripts.create(
            keys,
            source_keys,
            content_type=content_type,
            ttl_s=made.ttl_s,
            expires_ms=made.expires_ms,
            expires_at=made.expires_at,
            closed=made.closed,
            body=data,
            incarnation=secrets.token_hex(8),
            raw_content_type=made.content_type,
            quota=self.quota,
            fork=fork.signature if fork is not None else NO_FORK,
            part=fork.part if fork is not None else b"",
        )
        match reply:
            case StreamMade():
                if reply.created and self.on_write is not None:
                    self.on_write(tenant)
                # The type as the stream keeps it (as its creator wrote it), else this one's.
                return dataclasses.replace(
                    reply, content_type=reply.content_type or made.content_type
                )
            case ConfigConflict(what):
                raise Conflict(
                    f"the stream exists with another configuration ({what})",
                    code="stream_exists",
                )
            case SourceMissing():
                raise errors.source_missing()
            case SourceDeleted():
                raise errors.source_deleted()
            case PastTail():
                raise errors.past_tail()
            case TooDeep(max_depth):
                raise errors.bad_fork(f"a fork reads through at most {max_depth} streams")
            case RateRefused() | QuotaRefused():
                raise errors.refusal(reply, self._settings, self._metrics)

    async def _fork(self, keys: StreamKeys, request: ForkRequest) -> _Fork:
        """The fork ``request`` asks for; 400, 404 or 409 when it cannot be made.

        A fork has its source's appends up to the divergence point, with their offsets, and,
        with a sub-offset, the first bytes (or JSON values) of the next append, as an entry
        right after that point: it is then a stream of its own, which its source's later
        appends, closing or deletion never touch. Nothing is copied: ``ds_create`` records the
        source, the point and the chain a read follows; only the one append a sub-offset cuts
        is read here.
        """
        if request.source == keys.path:
            raise errors.bad_fork("a stream cannot fork itself")
        source = self._keys(keys.tenant, request.source)
        meta = await self._meta(source)
        if meta is None:
            raise errors.source_missing()
        if meta.deleted:
            raise errors.source_deleted()
        at = meta.tail if request.offset is None else protocol.cursor_of(request.offset)
        if at.key > meta.tail.key:
            raise errors.past_tail()
        part = b""
        if request.sub:
            following = await self._next_append(source, meta, at)
            if following is None:
                raise errors.bad_fork("nothing follows the fork offset to take a sub-offset of")
            json = protocol.is_json(meta.content_type)
            part = protocol.prefix(following, request.sub, json=json)
        given = "" if request.offset is None else at.entry_id
        sub = str(request.sub) if request.sub else ""
        return _Fork(meta, Fork(request.source, given, at.entry_id, sub), part)

    async def append(self, tenant: str | None, path: str, request: AppendRequest) -> AppendDone:
        """Append, close, or both; a producer's batch sent again is answered, not written twice.
        The protocol's order of refusals: a missing, deleted or closed stream before a body
        that is not JSON, then the content type, the producer, Stream-Seq and the limits."""
        keys = self._keys(tenant, path)
        body = request.body
        content_type = ""
        if not body and not request.close:
            raise BadRequest("an append needs a body (or Stream-Closed: true)", code="empty_append")
        if body:
            content_type = protocol.media_type(request.content_type)
            if not content_type:
                raise BadRequest("an append with a body needs its Content-Type", code="no_type")
            if content_type == protocol.JSON_TYPE:
                try:
                    body = protocol.json_messages(body, allow_empty=False)
                except BadRequest:
                    await self._refusal_before_json(keys)
                    raise
        one = OneAppend(
            content_type, body, request.close, request.producer, request.stream_seq or ""
        )
        reply = await self._groups.append(keys, one)
        if isinstance(reply, Appended) and self.on_write is not None:
            self.on_write(tenant)
        if isinstance(reply, Appended | Duplicate | ClosedAgain):
            return reply
        raise self._append_refusal(reply)

    async def _append_groups(
        self, groups: Sequence[tuple[StreamKeys, Sequence[OneAppend]]]
    ) -> list[list[AppendReply] | Exception]:
        """A ``ds_append`` call for each group of appends, in one round trip
        (:mod:`broker.durable_store.groups`)."""
        return await self._scripts.append_many(
            groups, max_entries=self._settings.ds_max_appends, quota=self.quota
        )

    def _append_refusal(
        self,
        reply: Missing
        | Gone
        | Closed
        | TypeMismatch
        | StaleProducer
        | EpochNotAtZero
        | SequenceGap
        | StreamSeqBehind
        | Full
        | RateRefused
        | QuotaRefused,
    ) -> BrokerError:
        match reply:
            case Missing():
                return errors.no_stream()
            case Gone():
                return errors.deleted()
            case Closed(tail):
                return errors.closed(tail)
            case TypeMismatch(content_type):
                return errors.type_mismatch(content_type)
            case StaleProducer(epoch):
                return errors.stale_epoch(epoch)
            case EpochNotAtZero():
                return errors.epoch_not_at_zero()
            case SequenceGap(expected, received):
                return errors.sequence_gap(expected, received)
            case StreamSeqBehind(last):
                return errors.stream_seq_behind(last)
            case Full(max_appends):
                return errors.full(max_appends)
            case RateRefused() | QuotaRefused():
                return errors.refusal(reply, self._settings, self._metrics)

    async def _refusal_before_json(self, keys: StreamKeys) -> None:
        """Raise what the stream itself refuses before a body is parsed (it is missing, deleted
        or closed): those come first, as the protocol orders them."""
        meta = await self._found(keys)
        if meta.closed:
            raise errors.closed(meta.tail)

    async def delete(self, tenant: str | None, path: str) -> None:
        """Delete a stream, or mark it so while forks of it live (its path answers 410 until
        the last goes); 404 for none, 410 for one marked already. A fork deleted gives its
        source's reference back, and a source deleted before it goes with its last fork, up
        the chain, in the same script (a fork made by copy, before forks read by reference,
        gives it back in a second: ``ds_fork_ref``)."""
        keys = self._keys(tenant, path)
        for fork in await rc.smembers(self._redis, keys.forks):
            gone = self._keys(tenant, fork)
            if not await self._redis.exists(gone.meta, gone.forks):  # (forks of it: it is kept)
                await self._redis.srem(keys.forks, fork)  # expired: its reference with it
        reply = await self._scripts.delete(keys)
        match reply:
            case Missing():
                raise errors.no_stream()
            case Gone():
                raise errors.deleted()
            case Removed(source) if source:
                await self._give_back(tenant, source, path)

    async def _give_back(self, tenant: str | None, source: str, fork: str) -> None:
        """Give ``fork``'s reference on ``source`` back; a deleted source goes with its last
        fork, and gives its own source's reference back in turn."""
        while source:
            reply = await self._scripts.fork_ref(self._keys(tenant, source), fork)
            if not isinstance(reply, Removed):
                return
            source, fork = reply.source, source

    # --- reads --------------------------------------------------------------------------------

    async def meta(self, tenant: str | None, path: str) -> Meta:
        """The stream's metadata; 404 for no such stream, 410 for a deleted one."""
        return await self._found(self._keys(tenant, path))

    async def _found(self, keys: StreamKeys) -> Meta:
        meta = await self._meta(keys)
        if meta is None:
            raise errors.no_stream()
        if meta.deleted:
            raise errors.deleted()
        return meta

    async def _meta(self, keys: StreamKeys) -> Meta | None:
        return Meta.of(await rc.hmget(self._redis, keys.meta, META_FIELDS))

    async def _next_append(self, keys: StreamKeys, meta: Meta, after: Cursor) -> bytes | None:
        """The payload of the first append past ``after`` (its own, or one it inherits), if any."""
        page = await rc.xrange_bytes(self._redis, keys.data, "(" + after.entry_id, "+", 2)
        read = await self._collect(keys, meta, after, page, limit=1)
        return read.payloads[0] if read.payloads else None

    async def read(
        self, tenant: str | None, path: str, after: Cursor | None, *, places: bool = True
    ) -> Read:
        """The appends past ``after`` (None: the stream's tail), up to about
        ``BROKER_DS_MAX_READ_BYTES``; 404 for no such stream, 410 for a deleted one. A read of a
        stream with a TTL starts its countdown again. Without ``places`` the read keeps only
        the bytes and the place after the last (a catch-up answer's), read in Redis
        (``ds_read``), and may stop short of the tail (at most :data:`PAGE_ENTRIES` appends)."""
        read = await self._read(self._keys(tenant, path), after, places)
        if read is None:
            raise errors.no_stream()
        if read.meta.deleted:
            raise errors.deleted()
        return read

    async def read_on(
        self, tenant: str | None, path: str, after: Cursor, *, places: bool = True
    ) -> Read | None:
        """The appends past ``after`` of a stream read before (None: it is gone since)."""
        return await self._read(self._keys(tenant, path), after, places)

    async def _read(self, keys: StreamKeys, after: Cursor | None, places: bool) -> Read | None:
        if after is not None and not places:
            page = await self._scripts.read(
                keys,
                after.entry_id,
                max_bytes=self._settings.ds_max_read_bytes,
                max_entries=PAGE_ENTRIES,
                meta=True,
            )
            meta = Meta.of(page.meta or [None] * len(META_FIELDS))
            if meta is None:
                return None
            # A fork's inherited part, or an older release's text, is read entry by entry.
            if not meta.chain and (page.payloads or page.state != "text"):
                if meta.ttl_s is not None:
                    await self._scripts.touch(keys, meta.ttl_s)
                return _paged(meta, after, page)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.meta, META_FIELDS)
            if after is not None:
                start = "(" + after.entry_id
                args = ("XRANGE", keys.data, start, "+", "COUNT", READ_COUNT)
                pipe.execute_command(*args, **rc.UNDECODED)
            replies = await pipe.execute()
        meta = Meta.of(replies[0])
        if meta is None:
            return None
        if meta.ttl_s is not None:
            await self._scripts.touch(keys, meta.ttl_s)
        if after is None:  # from the tail: nothing to read, closed if it is
            return Read(meta, [], [], meta.tail, True, meta.closed)
        return await self._collect(keys, meta, after, rc.flat_entries(replies[1]))

    async def _collect(
        self,
        keys: StreamKeys,
        meta: Meta,
        after: Cursor,
        page: rc.ByteEntries,
        limit: int | None = None,
    ) -> Read:
        """The read past ``after``: what a fork inherits first, from its chain's streams (its
        farthest source first, each up to the last entry it reads there), then its own data:
        ``page`` (read past ``after`` already: a fork's own entries all follow what it
        inherits) and the pages after it, up to ``limit`` bytes (``BROKER_DS_MAX_READ_BYTES``)."""
        taken = _Taken(after, self._settings.ds_max_read_bytes if limit is None else limit)
        for member, bound in reversed(meta.chain):
            data = self._space.data_of(keys.tenant, member)
            count = READ_COUNT
            while Cursor.after(bound).key > taken.cursor.key:
                start = "(" + taken.cursor.entry_id
                chunk = await rc.xrange_bytes(self._redis, data, start, bound, count)
                if taken.take(chunk) is _FULL:
                    return taken.read(meta, up_to_date=False, closed=False)
                if len(chunk) < count:
                    break
                count = min(2 * count, MAX_READ_COUNT)
        count = READ_COUNT  # (the first page's, read with the stream's metadata)
        while True:
            state = taken.take(page)
            if state is not _MORE:
                ended = state is _ENDED  # the close entry: the end, and the tail
                return taken.read(meta, up_to_date=ended, closed=ended)
            if len(page) < count:
                return taken.read(meta, up_to_date=True, closed=False)
            start = "(" + taken.cursor.entry_id
            count = min(2 * count, MAX_READ_COUNT)
            page = await rc.xrange_bytes(self._redis, keys.data, start, "+", count)

    async def wait(self, tenant: str | None, path: str, after: Cursor, timeout_s: float) -> None:
        """Return once something may be stored past ``after`` (an append, a close), or after
        ``timeout_s``. Waiting rides the stream's feed: no Redis command per waiting reader."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        subscription = self._hub.subscribe(self._keys(tenant, path).data, after, bare=True)
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
