"""Redis pools for one server: the fast ones, and redis-py's own as the way back.

:func:`make_pool` builds the pool of a single-server client (``broker.connection.client``):

* **Fast** (the fast path on): :class:`FastPool` / :class:`FastBlockingPool` take and return a
  connection without redis-py's per-call extras when they can (a deprecation check of the
  arguments, lock round trips, an event dispatch and observability records: a large share of
  the CPU of a short command, see ``benchmarks/RESULTS.md``), keep their idle connections in an
  :class:`IdleStack` that knows which ones no call took since the last trim, and (before Python
  3.12) send through a :class:`DirectSendConnection`, which hands a command to the transport
  without a task of its own when the socket takes it whole. Private names:
  ``ConnectionPool._available_connections`` (a list, most recently released last, popped from
  the end), ``._in_use_connections`` (a set), ``BlockingConnectionPool._condition`` (the
  condition its takes wait on); ``AbstractConnection._writer`` (an ``asyncio.StreamWriter``;
  before Python 3.12 only).
* **Stock** (the fast path off): redis-py's ``ConnectionPool``, or for a client that waits for
  a connection a bounded ``BlockingConnectionPool``, as redis-py makes them. Idle connections
  are then never trimmed (:func:`trim_idle` closes none), and :func:`drop_idle` is redis-py's
  ``disconnect(inuse_connections=False)``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterable
from typing import Any, SupportsIndex, cast

from redis.asyncio import BlockingConnectionPool, ConnectionPool
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("broker.connection")

# Whether the fast pools send through DirectSendConnection: from Python 3.12 on, asyncio.wait_for
# makes no task of its own, and redis-py's own send is about as fast (benchmarks/RESULTS.md).
DIRECT_SEND = sys.version_info < (3, 12)


def make_pool(url: str, *, fast: bool, wait_s: float | None, **options: Any) -> ConnectionPool:
    """The pool of a client for ``url``: fast or stock (see the module); with ``wait_s``, a
    take that finds every connection busy waits that long for one (a bounded
    ``BlockingConnectionPool``), else it fails at once."""
    pool: ConnectionPool
    if not fast:
        if wait_s is None:
            return ConnectionPool.from_url(url, **options)
        return BlockingConnectionPool.from_url(url, timeout=wait_s, **options)
    if wait_s is None:
        pool = FastPool.from_url(url, **options)
    else:
        pool = FastBlockingPool.from_url(url, timeout=wait_s, **options)
    if DIRECT_SEND:
        pool.connection_class = _direct_send(pool.connection_class)
    return pool


class IdleStack(list[AbstractConnection]):
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


class DirectPool(ConnectionPool):
    """A pool whose idle connections are an :class:`IdleStack`, and that hands them out and
    takes them back without redis-py's per-call extras when it can.

    A take that needs no wait is done here without an await, which the event loop makes
    atomic, and so is a return; a take that must wait for a connection (the waiting pool's),
    and any pool with redis-py's maintenance notifications or a credential provider (whose
    listeners run on each return), go through redis-py's own path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._available_connections = IdleStack(self._available_connections)

    def reset(self) -> None:
        super().reset()  # type: ignore[no-untyped-call]
        self._available_connections = IdleStack()

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


class FastPool(DirectPool):
    """A ``ConnectionPool`` on the direct path (see :class:`DirectPool`)."""


class FastBlockingPool(DirectPool, BlockingConnectionPool):
    """A ``BlockingConnectionPool`` on the direct path (see :class:`DirectPool`): a take that
    finds every connection busy waits, as redis-py's does, and each return wakes one that
    waits."""

    _waiting = 0  # takes waiting in redis-py's path for a connection

    async def get_connection(
        self, command_name: Any = None, *keys: Any, **options: Any
    ) -> AbstractConnection:
        if self._direct() and self._can_take():
            return await super().get_connection()
        self._waiting += 1
        try:
            return await super().get_connection()
        finally:
            self._waiting -= 1

    def _can_take(self) -> bool:
        return bool(self.can_get_connection())

    async def _returned(self) -> None:
        if self._waiting:  # a take waits for a connection: wake one, as redis-py's return does
            async with self._condition:
                self._condition.notify()


class DirectSendConnection(AbstractConnection):
    """A connection that sends a command without a task of its own when the socket takes it
    whole.

    redis-py bounds each send by the socket timeout with ``asyncio.wait_for``, which before
    Python 3.12 runs the send in a new task: a task, a timer and two more turns of the event
    loop for every command, though a send waits only when the socket's buffer is full. Here the
    command is handed to the transport at once; only if part of it waits for the socket is the
    wait bounded by ``wait_for`` as redis-py's. The errors are redis-py's: a timeout or a broken
    socket disconnects and raises its ``TimeoutError`` or ``ConnectionError``.
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


_DIRECT_SEND: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def _direct_send(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` (the connection class the pool chose for its URL) with
    :class:`DirectSendConnection`'s send."""
    if issubclass(base, DirectSendConnection):
        return base
    sending = _DIRECT_SEND.get(base)
    if sending is None:
        sending = _DIRECT_SEND[base] = type(base.__name__, (DirectSendConnection, base), {})
    return sending


async def drop_idle(pool: ConnectionPool) -> None:
    """Close the pool's idle connections; it opens new ones when it needs them.

    A fast pool's are taken out of it before they are closed, as :func:`trim_idle` does:
    redis-py's ``disconnect`` closes them in tasks that run a turn later, and a call that took
    one meanwhile had its reply cut. A stock pool gets redis-py's own close.
    """
    if isinstance(pool, DirectPool):
        await trim_idle(pool, keep=0, floor=0)
    else:
        await pool.disconnect(inuse_connections=False)


async def trim_idle(pool: ConnectionPool, keep: int, floor: int) -> int:
    """Close the idle connections of a fast pool past ``keep``, and those no call took since the
    last trim down to ``floor``; take them out of the pool first, and return how many were
    closed. A stock pool is left as it is (0)."""
    if not isinstance(pool, DirectPool):
        return 0
    idle = pool._available_connections
    untouched = min(idle.untouched, len(idle)) if isinstance(idle, IdleStack) else 0
    drop = max(len(idle) - keep, min(untouched, len(idle) - floor), 0)
    surplus = idle[:drop]
    del idle[:drop]  # no await since the pool's list was read: nobody took one
    if isinstance(idle, IdleStack):
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
