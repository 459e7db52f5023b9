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

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, SupportsIndex, cast
from urllib.parse import parse_qsl, unquote

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.cluster import LoadBalancingStrategy
from redis.driver_info import DriverInfo
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

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
) -> Redis:
    """A client for ``url`` that answers strings.

    ``socket_timeout`` bounds every reply; a client used for blocking reads must be given more
    than its longest BLOCK, or a quiet stream reads as a dead server. With ``wait_s``, a call
    that finds all ``max_connections`` busy waits that long for one instead of failing at once.
    With ``from_replicas`` (a cluster only), reads go to a replica of the slot's primary (to the
    primary while it has none); writes still go to the primary.
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
    # every take and return of a connection goes through redis-py's locks (see _Marked).
    options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    pool: ConnectionPool
    if wait_s is None:
        pool = MarkedPool.from_url(url, **options)
    else:
        pool = MarkedBlockingPool.from_url(url, timeout=wait_s, **options)
    pool.connection_class = _sending_at_once(pool.connection_class)
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
    node = cluster.nodes_manager.get_node_from_slot(
        cluster.keyslot(key), strategy is not None, strategy
    )
    return {"target_nodes": node}


async def drop_idle_connections(redis: Redis) -> None:
    """Close the idle connections of ``redis``'s pool; the pool opens new ones when it needs them.

    After a connection failed, the others to the same server are suspect: a restarted server
    closed them all, and each would fail its next command in turn (the pool does not retry).
    They are taken out of the pool before they are closed, as :func:`trim_idle_connections`
    does: redis-py's ``disconnect`` closes them in tasks that run a turn later, and a call that
    took one meanwhile had its reply cut. A cluster client needs none of this: it drops a failed
    node's connections and refreshes its slot map itself.
    """
    if as_cluster(redis) is not None:
        return
    if _idle_list(redis) is None:  # (not redis-py's list: its own close, with its race)
        await redis.connection_pool.disconnect(inuse_connections=False)
        return
    await trim_idle_connections(redis, keep=0, floor=0)


def _idle_list(redis: Redis) -> list[AbstractConnection] | None:
    """The pool's list of idle connections, most recently released last (redis-py's own: a
    test holds this to what each pinned version does), or None if it has none such."""
    idle = getattr(redis.connection_pool, "_available_connections", None)
    return idle if isinstance(idle, list) else None


# Idle connections a pool keeps at most, the most recently used, and at least, however long
# they sat unused: :func:`trim_idle_connections` (every ``BROKER_POOL_TRIM_S``, see broker.app)
# closes the others.
POOL_KEEP_IDLE = 16
POOL_MIN_IDLE = 2


class _IdleStack(list[AbstractConnection]):
    """A pool's idle connections, knowing how many at the bottom no call took since the last trim.

    redis-py's pool hands out its most recently released connection first (``pop()`` off the
    end), so a connection below the lowest the stack went since the last trim was not taken once
    meanwhile: that depth is ``untouched``, lowered by every take and raised by the trim.
    """

    untouched = 0  # none at first: a pool's first trim period only marks

    def pop(self, index: SupportsIndex = -1) -> AbstractConnection:
        connection = super().pop(index)
        self.untouched = min(self.untouched, len(self))
        return connection


class _Marked(ConnectionPool):
    """A pool whose idle connections are an :class:`_IdleStack`, and that hands them out and
    takes them back without redis-py's per-call extras when it can.

    redis-py 8 wraps each take and return in a deprecation check of its arguments, lock round
    trips, an event dispatch and four observability records (no-ops unless configured): about
    30 µs of CPU of an 80 µs ``HGET`` on a 2-core machine, on every command the broker sends.
    A take that needs no wait is done here without an await, which the event loop makes
    atomic, and so is a return; a take that must wait for a connection (the waiting pool's),
    and any pool with redis-py's maintenance notifications or a credential provider (whose
    listeners run on each return), go through redis-py's own path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._available_connections = _IdleStack(self._available_connections)

    def reset(self) -> None:
        super().reset()  # type: ignore[no-untyped-call]
        self._available_connections = _IdleStack()

    async def get_connection(
        self, command_name: Any = None, *keys: Any, **options: Any
    ) -> AbstractConnection:
        # (redis-py's pool methods are untyped: their results are cast, their calls allowed.)
        if not self._direct() or not self._can_take():
            return cast(AbstractConnection, await super().get_connection())  # type: ignore[no-untyped-call]
        # As redis-py's: the most recently returned idle connection, or a new one (or
        # MaxConnectionsError past the bound, for a pool that does not wait).
        connection = cast(
            AbstractConnection,
            ConnectionPool.get_available_connection(self),  # type: ignore[no-untyped-call]
        )
        try:
            await self.ensure_connection(connection)
        except BaseException:
            await self.release(connection)
            raise
        return connection

    async def release(self, connection: AbstractConnection) -> None:
        if not self._direct():
            await super().release(connection)
            return
        self._in_use_connections.remove(connection)
        if connection.should_reconnect():  # type: ignore[no-untyped-call]
            await connection.disconnect()
        self._available_connections.append(connection)
        await self._returned()

    def _direct(self) -> bool:
        """Whether takes and returns may skip redis-py's path (see the class docstring)."""
        return (
            not self.maint_notifications_enabled()  # type: ignore[no-untyped-call]
            and self.connection_kwargs.get("credential_provider") is None
        )

    def _can_take(self) -> bool:
        """Whether a take needs no wait."""
        return True

    async def _returned(self) -> None:
        """A connection came back."""


class _SendsAtOnce(AbstractConnection):
    """A connection that sends a command without a task of its own when the socket takes it
    whole.

    redis-py 8 bounds each send by the socket timeout with ``asyncio.wait_for``, which on this
    Python runs the send in a new task: a task, a timer and two more turns of the event loop for
    every command the broker sends, though a send waits only when the socket's buffer is full.
    Here the command is handed to the transport at once; only if part of it waits for the
    socket is the wait bounded by ``wait_for`` as redis-py's (an ``HGET`` in a loop takes about
    a fifth less CPU, see benchmarks/RESULTS.md). The errors are redis-py's: a timeout or a
    broken socket disconnects and raises its ``TimeoutError`` or ``ConnectionError``.
    """

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        if not self.is_connected or not self.socket_timeout:
            await super().send_packed_command(command, check_health)
            return
        if check_health:
            await self.check_health()  # type: ignore[no-untyped-call]
        try:
            writer = self._writer
            if writer is None:  # (the health check's reconnect failed)
                raise RedisConnectionError("Connection closed by server.")
            if isinstance(command, str):
                command = command.encode()
            writer.writelines([command] if isinstance(command, bytes) else command)
            if writer.transport.get_write_buffer_size() == 0:
                await writer.drain()  # all sent: its checks only (a lost connection raises)
            else:
                await asyncio.wait_for(writer.drain(), self.socket_timeout)
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)
            number, message = ("UNKNOWN", exc.args[0]) if len(exc.args) == 1 else exc.args[:2]
            raise RedisConnectionError(
                f"Error {number} while writing to socket. {message}."
            ) from exc
        except BaseException:
            await self.disconnect(nowait=True)
            raise


_SENDING_AT_ONCE: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def _sending_at_once(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` (the connection class the pool chose for its URL) with :class:`_SendsAtOnce`'s
    send."""
    if issubclass(base, _SendsAtOnce):
        return base
    sending = _SENDING_AT_ONCE.get(base)
    if sending is None:
        sending = _SENDING_AT_ONCE[base] = type(base.__name__, (_SendsAtOnce, base), {})
    return sending


class MarkedPool(_Marked):
    """A ``ConnectionPool`` that marks its untouched idle connections (see :class:`_Marked`)."""


class MarkedBlockingPool(_Marked, BlockingConnectionPool):
    """A ``BlockingConnectionPool`` that marks its untouched idle connections (see
    :class:`_Marked`): a take that finds every connection busy waits, as redis-py's does, and
    each return wakes one that waits."""

    def _can_take(self) -> bool:
        return bool(self.can_get_connection())

    async def _returned(self) -> None:
        if getattr(self._condition, "_waiters", True):  # a take waits for a connection
            async with self._condition:
                self._condition.notify()


async def trim_idle_connections(
    redis: Redis, keep: int = POOL_KEEP_IDLE, floor: int = POOL_MIN_IDLE
) -> int:
    """Close the idle connections of ``redis``'s pool that a burst left behind, and take them out
    of the pool; return how many were closed.

    A burst (a thousand readers attaching at once) grows a pool to as many connections as
    commands were in flight, and redis-py keeps every one open for ever: file descriptors and
    Redis clients that never come back. Two rules bound what stays: no more than ``keep`` idle
    connections, the most recently used (the pool hands out its most recently released one
    first, so the ones at the far end have been idle longest); and of those, the ones no call took
    since the last trim go too, down to ``floor``. So a connection idle for a whole trim period is
    closed, and two periods after a burst the pool holds what the load since needed. They are taken
    out of the pool before they are closed (nothing else can take them meanwhile), and the pool
    opens new ones when it needs them again. A cluster client is left alone: its per-node pools
    are its own.
    """
    if as_cluster(redis) is not None:
        return 0
    idle = _idle_list(redis)
    if idle is None:
        return 0
    untouched = min(idle.untouched, len(idle)) if isinstance(idle, _IdleStack) else 0
    drop = max(len(idle) - keep, min(untouched, len(idle) - floor), 0)
    surplus = idle[:drop]
    del idle[:drop]  # no await since the pool's list was read: nobody took one
    if isinstance(idle, _IdleStack):
        idle.untouched = len(idle)
    closed = 0
    for connection in surplus:
        if getattr(connection, "is_connected", True):
            closed += 1
        try:
            await connection.disconnect()
        except (RedisError, OSError) as exc:  # a connection already broken: it is gone anyway
            log.debug("closing an idle Redis connection failed: %s", exc)
    return closed


async def connect(url: str) -> Redis:
    """Connect and ping; raise ``RedisConnectError`` with one line saying what failed."""
    # A burst of short calls (a thousand readers at once) waits for a connection, never fails.
    redis = client(url, wait_s=5.0)
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
