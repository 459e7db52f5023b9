"""A request's handles on its connection, for the fast HTTP protocol (see the package's docstring).

:class:`ConnectionWire` is the :class:`broker.sse.Wire` the fast protocol offers each request
(``scope[WIRE]``): a body write that frames a chunk and hands it to the transport at once, a
callback when the connection is lost, an abort, and a head held with the chunks written right
after it. :class:`TenantPlace` is the request's :class:`broker.fastpath.limits.Share`.
:class:`LazyEvent` and :class:`PipelineQueue` replace two of uvicorn's per-connection objects
with smaller ones. Private names touched here: ``RequestResponseCycle.transport`` (swapped for
a moment in :meth:`ConnectionWire.start`), ``chunked_encoding``, ``response_complete``,
``disconnected``, ``flow.write_paused``, and the two events it replaces with a
:class:`LazyEvent` (``message_event``, ``FlowControl._is_writable_event``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

from starlette.types import Message, Send

from broker.fastpath.limits import UNSENT_LIMIT

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class Connection(Protocol):
    """What a request's handles ask of the fast protocol's connection."""

    lost: bool
    on_lost: Callable[[], None] | None

    def abort(self) -> None: ...

    def hold(self, share: TenantPlace, tenant: str) -> bool: ...


class LazyEvent:
    """:class:`asyncio.Event`'s interface (``set``, ``clear``, ``is_set``, ``wait``), which makes
    the event, and its queue of waiters, only once someone waits: most never do."""

    __slots__ = ("_event", "_set")

    def __init__(self, *, is_set: bool = False) -> None:
        self._set = is_set
        self._event: asyncio.Event | None = None

    def is_set(self) -> bool:
        return self._set if self._event is None else self._event.is_set()

    def set(self) -> None:
        if self._event is None:
            self._set = True
        else:
            self._event.set()

    def clear(self) -> None:
        if self._event is None:
            self._set = False
        else:
            self._event.clear()

    async def wait(self) -> Literal[True]:
        event = self._event
        if event is None:
            event = self._event = asyncio.Event()
            if self._set:
                event.set()
        return await event.wait()


class PipelineQueue(list[Any]):
    """uvicorn's queue of pipelined requests (it uses ``appendleft``, ``pop`` and its truth):
    a list, far smaller empty than a deque."""

    __slots__ = ()

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


class ConnectionWire:
    """One request's :class:`broker.sse.Wire`: its response's chunks, framed, straight to the
    transport (see the module's docstring).

    The wire sits in its request's scope and holds the protocol, which holds the scope: a
    reference cycle. It is cut when the connection is lost (:meth:`cut`), so that a connection's
    objects go as soon as its request's task ends, not at the garbage collector's next full
    pass (ten thousand departed readers left tens of megabytes for it, which no allocator could
    give back in the meantime).
    """

    __slots__ = ("_callback", "_cycle", "_held", "_held_bytes", "_protocol")

    def __init__(self, protocol: Connection, cycle: RequestResponseCycle) -> None:
        self._protocol: Connection | None = protocol
        # This request's: a pipelined request has a cycle of its own.
        self._cycle: RequestResponseCycle | None = cycle
        self._callback: Callable[[], None] | None = None
        # The head and the chunks that follow it at once, until the loop's next turn (start).
        self._held: list[bytes] | None = None
        self._held_bytes = 0

    def cut(self) -> None:
        """Forget the connection, which is lost: every write declines from now on."""
        self._protocol = self._cycle = self._callback = self._held = None

    def write(self, body: bytes) -> bool:
        cycle = self._cycle
        if cycle is None or not _writable(cycle):
            return False
        if body:
            framed = b"%x\r\n%b\r\n" % (len(body), body)
            held = self._held
            if held is None:
                cycle.transport.write(framed)
            else:  # after the head, before the loop's next turn (see start)
                held.append(framed)
                self._held_bytes += len(framed)
                if self._held_bytes >= UNSENT_LIMIT:
                    self.flush()
        return True

    async def start(self, send: Send, message: Message) -> None:
        # uvicorn's send writes the head as it takes the start: that write is held, and goes
        # with the chunks written after it (uvicorn's headers, checks and state as they are).
        cycle = self._cycle
        if cycle is None:
            await send(message)
            return
        transport = cycle.transport
        held = _HeadBuffer(transport)
        cycle.transport = held  # type: ignore[assignment]
        try:
            await send(message)
        finally:
            cycle.transport = transport
        head = held.take()
        if not head:
            return
        if not _writable(cycle):  # a body with a length: uvicorn's send writes it
            transport.write(head)
            return
        self._held, self._held_bytes = [head], len(head)
        asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        held, self._held = self._held, None
        cycle = self._cycle
        if held and cycle is not None and not cycle.disconnected:
            cycle.transport.write(b"".join(held))

    def abort(self) -> None:
        protocol = self._protocol
        if protocol is not None:
            protocol.abort()

    def when_lost(self, callback: Callable[[], None] | None) -> None:
        protocol, cycle = self._protocol, self._cycle
        if callback is None:  # forget this request's own, never a later request's
            if protocol is not None and protocol.on_lost is self._callback:
                protocol.on_lost = None
            self._callback = None
        elif protocol is None or cycle is None or protocol.lost or cycle.disconnected:
            callback()
        else:
            self._callback = protocol.on_lost = callback


class TenantPlace:
    """One request's :class:`broker.api.limits.Share`: its place in its tenant's share, held
    by the connection until the request's response completes or the connection is lost."""

    __slots__ = ("_cycle", "_protocol", "tenant")

    def __init__(self, protocol: Connection, cycle: RequestResponseCycle) -> None:
        self._protocol: Connection | None = protocol
        self._cycle: RequestResponseCycle | None = cycle
        self.tenant: str | None = None  # set while the request is counted

    def cut(self) -> None:
        self._protocol = self._cycle = None

    def hold(self, tenant: str) -> bool:
        protocol, cycle = self._protocol, self._cycle
        if protocol is None or cycle is None or cycle.response_complete or cycle.disconnected:
            return True  # over already: there is nothing left to count
        return protocol.hold(self, tenant)


def _writable(cycle: RequestResponseCycle) -> bool:
    """Whether a chunk of ``cycle``'s body can be handed to the transport now."""
    return bool(
        cycle.chunked_encoding  # not started yet, or sized, or a HEAD: no
        and not cycle.response_complete
        and not cycle.disconnected
        and not cycle.flow.write_paused
    )


class _HeadBuffer:
    """A transport whose writes are held (see :meth:`ConnectionWire.start`); anything else is the
    transport's own."""

    __slots__ = ("_held", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._held.append(data)

    def take(self) -> bytes:
        data = b"".join(self._held)
        self._held.clear()
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
