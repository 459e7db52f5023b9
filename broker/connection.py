"""Connecting to Redis: one clear line when it fails, a loud warning when eviction is on."""

from __future__ import annotations

import logging
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import RedisError, ResponseError

from broker.errors import BrokerError

log = logging.getLogger("broker.connection")

# Stream reads on the broker's clients answer Redis's own shape, [id, [field, value, ...]],
# instead of a dict per entry: building those dicts was the largest cost of a replay.
# ``redis_calls`` accepts both shapes.
RAW_STREAM_REPLIES = ("XRANGE", "XREVRANGE", "XREAD")


def _as_sent(response: Any, **options: Any) -> Any:
    return response


class RedisConnectError(BrokerError, RuntimeError):
    """Redis could not be reached at start."""

    code = "redis_unreachable"


def redact(url: str) -> str:
    """The URL with any password replaced, for logs and error messages."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    credentials, _, host = rest.rpartition("@")
    user = credentials.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{host}" if user else f"{scheme}{sep}***@{host}"


def client(
    url: str,
    *,
    max_connections: int = 512,
    socket_timeout: float = 10.0,
    wait_s: float | None = None,
) -> Redis:
    """A client for ``url`` that answers strings.

    ``socket_timeout`` bounds every reply; a client used for blocking reads must be given more
    than its longest BLOCK, or a quiet stream reads as a dead server. With ``wait_s``, a call
    that finds all ``max_connections`` busy waits that long for one instead of failing at once.
    """
    options: dict[str, Any] = {
        "decode_responses": True,
        "max_connections": max_connections,
        "socket_connect_timeout": 5,
        "socket_timeout": socket_timeout,
        "health_check_interval": 30,
    }
    if wait_s is None:
        redis = Redis.from_url(url, **options)
    else:
        pool = BlockingConnectionPool.from_url(url, timeout=wait_s, **options)
        redis = Redis(connection_pool=pool)
    for command in RAW_STREAM_REPLIES:
        redis.set_response_callback(command, _as_sent)
    return redis


async def drop_idle_connections(redis: Redis) -> None:
    """Close the idle connections of ``redis``'s pool; each reconnects when next used.

    After a connection failed, the others to the same server are suspect: a restarted server
    closed them all, and each would fail its next command in turn (the pool does not retry).
    """
    await redis.connection_pool.disconnect(inuse_connections=False)


async def connect(url: str) -> Redis:
    """Connect and ping; raise ``RedisConnectError`` with one line saying what failed."""
    # A burst of short calls (a thousand readers at once) waits for a connection, never fails.
    redis = client(url, wait_s=5.0)
    try:
        await redis.ping()
    except (RedisError, OSError) as exc:
        await redis.aclose()
        raise RedisConnectError(f"cannot connect to Redis at {redact(url)}: {exc}") from None
    return redis


async def eviction_policy(redis: Redis) -> str | None:
    """The server's ``maxmemory-policy``, or None where CONFIG is not allowed (managed Redis)."""
    try:
        reply = await redis.config_get("maxmemory-policy")
    except ResponseError:
        return None
    value = reply.get("maxmemory-policy")
    return str(value) if value is not None else None


async def check_eviction_policy(redis: Redis) -> str | None:
    """Warn loudly unless Redis refuses writes rather than evicting keys (streams would vanish)."""
    policy = await eviction_policy(redis)
    if policy is None:
        log.warning(
            "could not read maxmemory-policy (CONFIG GET refused); make sure it is 'noeviction', "
            "or Redis may silently delete streams that clients are reading"
        )
    elif policy != "noeviction":
        log.warning(
            "!!! Redis maxmemory-policy is %r, not 'noeviction': under memory pressure Redis will "
            "DELETE streams, leases and turns that clients are reading. Set "
            "'maxmemory-policy noeviction' on this server. !!!",
            policy,
        )
    return policy
