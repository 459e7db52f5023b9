"""Connecting to Redis: one clear line when it fails, a loud warning when eviction is on.

``BROKER_REDIS_URL`` names one server (``redis://``, ``rediss://``, ``unix://``) or a Redis Cluster
(``redis+cluster://[user:password@]host:port,host:port`` or ``rediss+cluster://`` with TLS, which
takes the TLS options of :data:`CLUSTER_TLS_OPTIONS` as a query): one or more of its nodes, from
which the client learns the rest. A cluster client follows MOVED and
ASK redirects and refreshes its slot map when the topology changes. It serves the same commands
as the single-server client for the broker's keys (every command touches one slot, or one
conversation's slot), so the rest of the broker holds either as a ``Redis``.
"""

from __future__ import annotations

import logging
from typing import Any, cast
from urllib.parse import parse_qsl, unquote

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.cluster import LoadBalancingStrategy
from redis.driver_info import DriverInfo
from redis.exceptions import (
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
)
from redis.maint_notifications import MaintNotificationsConfig

from broker.errors import BrokerError
from broker.fastpath.redis_pool import drop_idle, make_pool, trim_idle

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


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
# A cluster client's connections per node: it has no waiting pool, so the cap is set high.
CLUSTER_MAX_CONNECTIONS = 10_000


# The query options a TLS cluster URL takes, as redis-py names them for a single server's URL.
CLUSTER_TLS_OPTIONS = (
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
)
CERT_REQS = ("none", "optional", "required")


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The ``(host, port)`` nodes a cluster URL names, and its connection options (TLS, user,
    password). Raises ``RedisConnectError`` for a URL it cannot read (never repeating it)."""
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    rest, _, database = rest.partition("/")
    if database not in ("", "0"):
        raise RedisConnectError(
            "a cluster URL takes no database (a cluster has only database 0): "
            "redis+cluster://host:port,host:port"
        )
    credentials, _, hosts = rest.rpartition("@")
    options: dict[str, Any] = {"ssl": scheme == "rediss+cluster"}
    if query:
        options |= _tls_options(query, tls=options["ssl"])
    if credentials:
        user, colon, password = credentials.partition(":")
        options["username"] = unquote(user) or None
        options["password"] = unquote(password) if colon else None
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not host or not port.isdigit():
            raise RedisConnectError(
                f"a cluster URL lists host:port nodes separated by commas ({redact(url)})"
            )
        nodes.append((host, int(port)))
    return nodes, options


def _tls_options(query: str, *, tls: bool) -> dict[str, Any]:
    """The TLS options of a cluster URL's query; ``RedisConnectError`` for any other."""
    if not tls:
        raise RedisConnectError(
            "only a TLS cluster URL (rediss+cluster://) takes options: "
            + ", ".join(CLUSTER_TLS_OPTIONS)
        )
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in CLUSTER_TLS_OPTIONS:
            raise RedisConnectError(
                f"a cluster URL takes no option {name[:40]!r}; it takes "
                + ", ".join(CLUSTER_TLS_OPTIONS)
            )
        if name == "ssl_cert_reqs":
            if value not in CERT_REQS:
                raise RedisConnectError(f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}")
            options[name] = value
        elif name == "ssl_check_hostname":
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise RedisConnectError("ssl_check_hostname must be true or false")
            options[name] = value.lower() in ("true", "1", "yes")
        else:
            options[name] = value
    return options


def client(
    url: str,
    *,
    max_connections: int = 512,
    socket_timeout: float = 10.0,
    wait_s: float | None = None,
    from_replicas: bool = False,
    fast: bool = True,
) -> Redis:
    """A client for ``url`` that answers strings.

    ``socket_timeout`` bounds every reply; a client used for blocking reads must be given more
    than its longest BLOCK, or a quiet stream reads as a dead server. With ``wait_s``, a call
    that finds all ``max_connections`` busy waits that long for one instead of failing at once.
    With ``from_replicas`` (a cluster only), reads go to a replica of the slot's primary (to the
    primary while it has none); writes still go to the primary. ``fast`` picks the fast path's
    pool for a single server, or redis-py's own (:func:`broker.fastpath.make_pool`).
    """
    options: dict[str, Any] = {
        "decode_responses": True,
        "max_connections": max_connections,
        "socket_connect_timeout": 5,
        "socket_timeout": socket_timeout,
        "health_check_interval": 30,
        # No CLIENT SETINFO (two commands) on each new connection: a burst of readers opens a
        # few hundred, and CLIENT LIST's lib-name is all they would buy.
        "driver_info": DriverInfo(name=None, lib_version=None),
    }
    if is_cluster_url(url):
        if from_replicas:
            options["load_balancing_strategy"] = LoadBalancingStrategy.ROUND_ROBIN_REPLICAS
        return _cluster_client(url, options)
    # No maintenance notifications (a RESP3 feature of managed Redis that moves connections
    # ahead of a failover; the broker rides a failover on its own retries and leases): with
    # them on ("auto", redis-py's default) every connection asks for them as it opens, and
    # every take and return of a connection goes through redis-py's locks.
    options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    pool = make_pool(url, fast=fast, wait_s=wait_s, **options)
    redis = Redis.from_pool(pool)  # closing the client closes its pool
    for command in RAW_STREAM_REPLIES:
        redis.set_response_callback(command, _as_sent)
    return redis


def _cluster_client(url: str, options: dict[str, Any]) -> Redis:
    nodes, extra = cluster_nodes(url)
    cluster = RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        **{**options, "max_connections": CLUSTER_MAX_CONNECTIONS, **extra},
    )
    for command in RAW_STREAM_REPLIES:
        cluster.set_response_callback(command, _as_sent)
    # The broker calls only commands both clients serve, each on one slot (see the module).
    return cast(Redis, cluster)


def as_cluster(redis: Redis) -> RedisCluster | None:
    """``redis`` as the cluster client it is, or None for a single-server client."""
    value: object = redis
    return value if isinstance(value, RedisCluster) else None


def route(redis: Redis, key: str, *, read: bool = False) -> dict[str, Any]:
    """The keyword that sends a command on ``key`` straight to the node serving it, on a cluster
    (a replica for a ``read`` by a client that reads replicas); ``{}`` for one server.

    Without it, redis-py's cluster client asks a node where the keys of ``XREAD`` and
    ``XREADGROUP`` are (``COMMAND GETKEYS``, twice) on every call: three round trips for one.
    A redirect (a moved slot) is still followed.
    """
    cluster = as_cluster(redis)
    if cluster is None:
        return {}
    strategy = cluster.load_balancing_strategy if read else None
    try:
        node = cluster.nodes_manager.get_node_from_slot(
            cluster.keyslot(key), strategy is not None, strategy
        )
    except (KeyError, SlotNotCoveredError):
        # The client has no slot map yet (a client's first command builds it), or its map
        # lacks the slot: redis-py's own routing finds the node, at the price of its round
        # trips, and builds or refreshes the map.
        return {}
    return {"target_nodes": node}


async def drop_idle_connections(redis: Redis) -> None:
    """Close the idle connections of ``redis``'s pool; the pool opens new ones when it needs them.

    After a connection failed, the others to the same server are suspect: a restarted server
    closed them all, and each would fail its next command in turn (the pool does not retry).
    A cluster client needs none of this: it drops a failed node's connections and refreshes its
    slot map itself.
    """
    if as_cluster(redis) is None:
        await drop_idle(redis.connection_pool)


# Idle connections a pool keeps at most, the most recently used, and at least, however long
# they sat unused: :func:`trim_idle_connections` (every ``BROKER_POOL_TRIM_S``, see broker.app)
# closes the others.
POOL_KEEP_IDLE = 16
POOL_MIN_IDLE = 2


async def trim_idle_connections(
    redis: Redis, keep: int = POOL_KEEP_IDLE, floor: int = POOL_MIN_IDLE
) -> int:
    """Close the idle connections of ``redis``'s pool that a burst left behind, and take them out
    of the pool; return how many were closed.

    A burst (a thousand readers attaching at once) grows a pool to as many connections as
    commands were in flight, and redis-py keeps every one open for ever: file descriptors and
    Redis clients that never come back. Two rules bound what stays: no more than ``keep`` idle
    connections, the most recently used; and of those, the ones no call took since the last
    trim go too, down to ``floor``. So a connection idle for a whole trim period is closed, and
    two periods after a burst the pool holds what the load since needed. Only the fast path's
    pools are trimmed (:func:`broker.fastpath.trim_idle`); a stock pool, and a cluster client's
    per-node pools, are left alone.
    """
    if as_cluster(redis) is not None:
        return 0
    return await trim_idle(redis.connection_pool, keep, floor)


async def connect(url: str, *, fast: bool = True) -> Redis:
    """Connect and ping; raise ``RedisConnectError`` with one line saying what failed."""
    # A burst of short calls (a thousand readers at once) waits for a connection, never fails.
    redis = client(url, wait_s=5.0, fast=fast)
    try:
        await redis.ping()
    except (RedisError, RedisClusterException, OSError) as exc:  # a cluster's: no node answered
        await redis.aclose()
        raise RedisConnectError(f"cannot connect to Redis at {redact(url)}: {exc}") from None
    return redis


async def eviction_policy(redis: Redis) -> str | None:
    """The server's ``maxmemory-policy``, or None where CONFIG is not allowed (managed Redis).

    On a cluster, every primary is asked: the answer is ``noeviction`` only if all say so.
    """
    cluster = as_cluster(redis)
    try:
        if cluster is not None:
            replies = await cluster.config_get(
                "maxmemory-policy", target_nodes=RedisCluster.PRIMARIES
            )
            policies = _policies(replies)
            if not policies:
                return None
            others = sorted(policies - {"noeviction"})
            return others[0] if others else "noeviction"
        reply = await redis.config_get("maxmemory-policy")
    except ResponseError:
        return None
    value = reply.get("maxmemory-policy")
    return str(value) if value is not None else None


def _policies(replies: Any) -> set[str]:
    """The policies of a cluster's CONFIG GET: one dict, or one per node."""
    found: set[str] = set()
    items = replies.values() if isinstance(replies, dict) else [replies]
    for item in items:
        if isinstance(item, dict) and "maxmemory-policy" in item:
            found.add(str(item["maxmemory-policy"]))
        elif isinstance(item, str):
            found.add(item)
    return found


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
