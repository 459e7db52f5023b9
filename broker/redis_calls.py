"""Typed views of the few redis-py calls whose replies the broker reads.

redis-py annotates replies for every client configuration (bytes or str, sync or async); the
broker's clients always decode to ``str``, so these helpers state that once instead of casting
at every call site. The few calls whose replies hold bytes that are not text (Durable Streams
payloads) ask for them undecoded, per call (:data:`UNDECODED`), and say so in their types.
"""

from __future__ import annotations

from typing import Any, cast

from redis.asyncio import Redis
from redis.client import NEVER_DECODE

from broker.connection import route

Entries = list[tuple[str, dict[str, str]]]
# A stream entry's fields as a broker client answers them (``connection.RAW_STREAM_REPLIES``):
# Redis's own flat list, field, value, field, value... A client with redis-py's usual parsing
# answers a dict; both are accepted everywhere.
Fields = list[str] | dict[str, str]
RawEntries = list[tuple[str, Fields]]
# Stream entries as Redis sends them, not decoded (redis-py's NEVER_DECODE): the id, then the
# flat list of fields and values, all bytes. For payloads that are bytes, not text.
ByteEntries = list[tuple[bytes, list[bytes]]]
UNDECODED: dict[str, Any] = {NEVER_DECODE: True}  # a call's keyword: its reply stays bytes


def fields_dict(fields: Fields) -> dict[str, str]:
    return fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2], strict=True))


async def get(redis: Redis, key: str) -> str | None:
    return cast(str | None, await redis.get(key))


async def hget(redis: Redis, key: str, field: str) -> str | None:
    return cast(str | None, await redis.hget(key, field))


async def hmget(redis: Redis, key: str, fields: list[str]) -> list[str | None]:
    return cast(list[str | None], await redis.hmget(key, fields))


async def hgetall(redis: Redis, key: str) -> dict[str, str]:
    return cast(dict[str, str], await redis.hgetall(key))


async def smembers(redis: Redis, key: str) -> list[str]:
    """The members of a set, sorted."""
    return sorted(cast(set[str], await redis.smembers(key)))


async def zrange_all(redis: Redis, key: str) -> list[str]:
    return cast(list[str], await redis.zrange(key, 0, -1))


async def xrange(redis: Redis, key: str, start: str, end: str = "+", count: int = 1000) -> Entries:
    return [(i, fields_dict(f)) for i, f in await xrange_raw(redis, key, start, end, count)]


async def xrange_raw(
    redis: Redis, key: str, start: str, end: str = "+", count: int = 1000
) -> RawEntries:
    """:func:`xrange` without a dict per entry: for replays, where those dicts cost the most."""
    return cast(RawEntries, await redis.xrange(key, min=start, max=end, count=count))


async def xrange_bytes(
    redis: Redis, key: str, start: str, end: str = "+", count: int = 1000
) -> ByteEntries:
    """:func:`xrange_raw` with the reply's bytes as Redis sent them (nothing decoded)."""
    args = ("XRANGE", key, start, end, "COUNT", count)
    reply = await redis.execute_command(*args, **UNDECODED)  # type: ignore[no-untyped-call]  # untyped in redis-py
    return flat_entries(reply)


def flat_entries(reply: Any) -> ByteEntries:
    """An undecoded XRANGE reply as Redis sent it: a client with redis-py's own parsing of
    stream replies (not the broker's, see ``connection.RAW_STREAM_REPLIES``) answers each
    entry's fields as a dict, made flat again here."""
    if reply and isinstance(reply[0][1], dict):
        return [(i, [x for pair in f.items() for x in pair]) for i, f in reply]
    return cast(ByteEntries, reply)


async def last_entry_id(redis: Redis, key: str) -> str | None:
    reply = cast(Entries, await redis.xrevrange(key, max="+", min="-", count=1))
    return reply[0][0] if reply else None


async def xread(
    redis: Redis, key: str, after: str, count: int, block_ms: int, *, undecoded: bool = False
) -> RawEntries:
    """XREAD BLOCK of one stream; ``undecoded``: its reply's bytes as Redis sent them (a
    :data:`ByteEntries`, for streams whose payloads are bytes)."""
    args = ("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", key, after)
    options = route(redis, key, read=True)
    if undecoded:
        options.update(UNDECODED)
    reply = await redis.execute_command(*args, **options)  # type: ignore[no-untyped-call]  # untyped in redis-py
    if not reply:
        return []
    if isinstance(reply, dict):  # RESP3: {key: entries}
        return cast(RawEntries, reply[key.encode() if undecoded else key])
    return cast(RawEntries, reply[0][1])  # RESP2: [[key, entries]]


async def xautoclaim(
    redis: Redis, key: str, group: str, consumer: str, min_idle_ms: int, count: int, start: str
) -> tuple[str, Entries, list[str]]:
    """The next cursor, the claimed entries, and ids of pending entries deleted meanwhile."""
    reply: list[Any] = await redis.xautoclaim(
        key, group, consumer, min_idle_time=min_idle_ms, start_id=start, count=count
    )
    deleted = cast(list[str], reply[2]) if len(reply) > 2 else []
    return str(reply[0]), cast(Entries, reply[1]), deleted
