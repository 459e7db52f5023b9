"""The HTTP protocol of the broker: uvicorn's httptools protocol, with limits per connection.

uvicorn 0.54 gives a connection no deadline before its request headers are complete, and with
httptools no bound on their size either: a client sending one byte a second holds its socket for
ever, and enough of them exhaust the process's file descriptors. This protocol adds:

* **A header deadline** (``BROKER_HEADER_TIMEOUT_S``), armed when a connection opens and when
  the first byte after a complete response arrives on it (stray line ends too: the parser
  begins no request for them, and any byte cancels uvicorn's keep-alive timer), and cancelled
  once that request's headers are complete. A response, however long (an SSE stream lasts as
  long as its turn), is never cut by it, nor is an idle keep-alive connection (uvicorn's
  ``timeout_keep_alive`` closes those). A client that sent part of a request gets a 408 before
  the close; one that sent nothing does not.
* **A body deadline** (``BROKER_BODY_TIMEOUT_S``), armed when a request's headers are complete
  and its body is not, and cancelled when the body is: past it, a 408 (unless the app answered
  already) and the close. A pipelined request's body, which waits while the request before it
  is served (reading is paused), gets a new period instead.
* **Closes that finish.** A close this protocol begins (a deadline, a refusal) is turned into an
  abort after ``CLOSE_GRACE_S`` if what it still had to send is not gone, and an event stream
  aborts its connection at its send timeout (:meth:`_Wire.abort`): a graceful close waits for a
  client that reads nothing for ever, socket and descriptor held. An abort sets ``SO_LINGER``
  to zero, so the kernel drops the unsent bytes and resets the connection at once rather than
  keep it (ESTABLISHED on the client's side) after the descriptor is gone.
* **Each caller's share** (:class:`CallerShares`). A client address holds at most
  ``per_address`` connections (addresses for which ``uncapped`` is true aside): the connection
  past it is answered 429 ``too_many_connections_for_caller`` with ``Retry-After`` once its
  request arrives, and a tenth past it is closed at once. A tenant has at most ``per_tenant``
  requests in flight: each request carries a :class:`broker.api.limits.Share` in its scope
  (``SHARE``), which the app holds for the request's tenant once its credentials are checked
  (``routes.authenticate``). The place is given back by the connection, when the response
  completes or the connection is lost: never by the request's task, which a cancellation lost
  in redis-py could keep running.
* **A header size cap** for the parser, above ``BROKER_MAX_HEADER_BYTES`` so that requests a
  little over the broker's limit still reach the app and its CORS-aware 431. Past the cap the
  431 is written here, with the same JSON body (no CORS headers); what the client still sends is
  read and dropped for a moment before the close, so that the close cannot reset the answer away.
* **A connection cap** (``BROKER_MAX_CONNECTIONS``). A connection opened while that many are
  open is answered 503 with ``Retry-After`` and closed once its request has arrived (clients
  retry, here or on another replica); a tenth past the cap, a new connection is closed at once,
  so that a flood cannot take every descriptor. Connections already admitted are never refused
  later: a stream broker's connections are long-lived, and uvicorn's ``limit_concurrency``
  (which would answer 503 to their next request too) is not used.
* **URLs past httptools' URL parser** (64 KiB) are split here, so that the app answers them with
  its JSON 431 instead of the parser's plain-text 400.
* **A wire for event streams** (``broker.sse.WIRE`` in each request's scope): a body write
  that frames the chunk and hands it to the transport at once, and a callback when the
  connection is lost. An event stream's heartbeats and live batches are then one transport
  write each, not an ASGI message and a coroutine through uvicorn's ``send``, and its response
  needs no task of its own waiting for ``http.disconnect``. The write declines (and the
  response falls back to ``send``, which waits) whenever uvicorn's would have to wait or do
  more than frame a chunk: the transport's buffer full, the connection or the response over, or
  a body that is not chunked. An event stream's head is held with the chunks written right
  after it, until the event loop's next turn or ``UNSENT_LIMIT`` bytes: an attach's head, its
  opening frame and the replay at hand are one write (each write to a loopback client cost
  about a tenth of an attach's CPU in the join workload's profile).
* **Less memory per connection**, for a process that holds ten thousand: uvicorn's two events
  per connection (the request's and the flow control's) get their waiters' queue only once
  someone waits (:class:`LazyEvent`), and its queue of pipelined requests is a list. An empty
  ``collections.deque`` takes 600 bytes; the three took 1.9 KiB of each quiet connection.
* **A bound on what is queued unsent** per connection: ``UNSENT_LIMIT`` in the kernel
  (``TCP_NOTSENT_LOWAT``, where the platform has it) and as the transport's high-water mark.
  Without it the kernel grows a connection's send buffer towards ``net.ipv4.tcp_wmem`` (4 MiB;
  about 3 MiB taken on loopback) for a client that reads nothing: such a client looks like a
  fast one, and its reader does the work of megabytes of events before any write waits. With it,
  a write waits after a few tens of KiB, so a response's flow control (and its send timeout)
  sees a slow client at once, and its reader stops reading Redis for it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import http
import ipaddress
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any, ClassVar, Literal
from urllib.parse import unquote

import orjson
from starlette.types import Message, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from broker.api.limits import CALLER_REFUSAL, CALLER_RETRY_AFTER_S, SHARE
from broker.api.security import COMMON
from broker.sse import WIRE

log = logging.getLogger("broker.connections")

# httptools.parse_url keeps offsets in 16 bits: a longer URL is refused with a parser error.
URL_PARSER_MAX = 0xFFFF
REFUSAL_RETRY_AFTER_S = 1
# How long a connection answered 431 mid-request is still read (and dropped) before the close.
LINGER_S = 2.0
# How long a close this protocol began may wait for its unsent bytes before the connection is
# aborted (a client that reads nothing would hold a graceful close open for ever).
CLOSE_GRACE_S = 2.0
# SO_LINGER on, with no time: the close of an aborted socket resets the connection at once and
# drops what is unsent, where the kernel would otherwise keep trying to send it (the client's
# side stays ESTABLISHED for as long) after the descriptor is gone.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
# Bytes the kernel, and the transport, may each hold unsent per connection (more may be in
# flight, as the client's window allows): enough to keep a client's link busy between two
# writes of the event loop, little for one that reads nothing.
UNSENT_LIMIT = 16_384
_NOTSENT_LOWAT: int | None = getattr(socket, "TCP_NOTSENT_LOWAT", None)


def _uncounted(reason: str) -> None:
    """The default counter: counts nothing."""


def _capped_nowhere(address: str) -> bool:
    return False


class CallerShares:
    """What each caller holds of one server's connections: open connections per client
    address, and requests in flight per tenant. Each count goes as its connection or request
    ends (see :class:`GuardedHttpProtocol`); a key at zero is removed."""

    __slots__ = ("addresses", "tenants")

    def __init__(self) -> None:
        self.addresses: dict[str, int] = {}
        self.tenants: dict[str, int] = {}


def _give_back(table: dict[str, int], key: str) -> None:
    left = table.get(key, 0) - 1
    if left > 0:
        table[key] = left
    else:
        table.pop(key, None)


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The limits one server applies to each of its connections."""

    header_timeout_s: float
    max_header_bytes: int  # the parser's cap, above BROKER_MAX_HEADER_BYTES
    max_connections: int
    count: Callable[[str], None] = _uncounted  # with one of metrics.CONNECTION_CLOSE_REASONS
    body_timeout_s: float = 30.0
    per_address: int = 0  # open connections of one client address; 0: no cap
    per_tenant: int = 0  # requests in flight of one tenant; 0: no cap
    uncapped: Callable[[str], bool] = _capped_nowhere  # addresses without the address cap
    refused: Callable[[str], None] = _uncounted  # with one of metrics.CALLER_CAPS
    shares: CallerShares = dataclasses.field(default_factory=CallerShares)

    @property
    def overflow(self) -> int:
        """Open connections past which a new one is closed unanswered."""
        return self.max_connections + max(1, self.max_connections // 10)

    @property
    def address_overflow(self) -> int:
        """Open connections of one address past which its new one is closed unanswered."""
        return self.per_address + max(1, self.per_address // 10)


def uncapped_addresses(
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...],
) -> Callable[[str], bool]:
    """Whether a client address is in one of ``networks`` (an IPv4-mapped IPv6 address as its
    IPv4 address): the test of ``ConnectionLimits.uncapped``."""

    def uncapped(address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in networks)

    return uncapped


class LazyEvent(asyncio.Event):
    """:class:`asyncio.Event`, with no queue of waiters until someone waits."""

    def __init__(self, *, is_set: bool = False) -> None:
        # Not asyncio.Event.__init__: it makes the deque this class is here to save.
        self._waiters = ()  # type: ignore[assignment]
        self._value = is_set

    async def wait(self) -> Literal[True]:
        if not isinstance(self._waiters, collections.deque):  # none waited yet
            self._waiters = collections.deque()
        return await super().wait()


class _Pipeline(list[Any]):
    """uvicorn's queue of pipelined requests (it uses ``appendleft``, ``pop`` and its truth):
    a list, which takes 56 bytes empty where a deque takes 600."""

    __slots__ = ()

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


class _Phase(enum.Enum):
    FRESH = "fresh"  # connection open (or bytes on a kept-alive one), no request begun yet
    HEADERS = "headers"  # a request has begun; its headers are not complete
    BODY = "body"  # headers complete: the app has the request; its body is still coming
    REQUEST = "request"  # the whole request arrived (then keep-alive)
    CLOSING = "closing"  # answered by this protocol; the rest of the request is dropped


def json_error(status: int, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with the broker's error body, that closes the connection."""
    body = orjson.dumps({"error": {"code": code, "message": message}})
    lines = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode(),
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
        *(name + b": " + value for name, value in COMMON),
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class _Wire:
    """One request's :class:`broker.sse.Wire`: its response's chunks, framed, straight to the
    transport (see the module's docstring).

    The wire sits in its request's scope and holds the protocol, which holds the scope: a
    reference cycle. It is cut when the connection is lost (:meth:`cut`), so that a connection's
    objects go as soon as its request's task ends, not at the garbage collector's next full
    pass (ten thousand departed readers left about 40 MB for it, which no allocator could give
    back in the meantime).
    """

    __slots__ = ("_callback", "_cycle", "_held", "_held_bytes", "_protocol")

    def __init__(self, protocol: GuardedHttpProtocol, cycle: RequestResponseCycle) -> None:
        self._protocol: GuardedHttpProtocol | None = protocol
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
        held = _HeldWrites(transport)
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


class _Share:
    """One request's :class:`broker.api.limits.Share`: its place in its tenant's share, held
    by the connection until the request's response completes or the connection is lost."""

    __slots__ = ("_cycle", "_protocol", "tenant")

    def __init__(self, protocol: GuardedHttpProtocol, cycle: RequestResponseCycle) -> None:
        self._protocol: GuardedHttpProtocol | None = protocol
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


class _HeldWrites:
    """A transport whose writes are held (see :meth:`_Wire.start`); anything else is the
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


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above; bind limits with :func:`guarded`.

    Its own state is in slots: uvicorn's protocol sets 28 attributes, and an instance
    dictionary with more than 30 keys stops sharing its keys with the class's other instances,
    which made each connection's dictionary 1.6 KiB instead of 0.3.
    """

    __slots__ = (
        "_address",
        "_deadline",
        "_header_bytes",
        "_held",
        "_phase",
        "lost",
        "on_lost",
    )
    limits: ClassVar[ConnectionLimits]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.pipeline = _Pipeline()  # type: ignore[assignment]
        self._phase = _Phase.FRESH
        self._header_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._address: str | None = None  # counted in the shares' addresses while open
        self._held: _Share | None = None  # the request counted against its tenant
        self.lost = False  # the connection is lost
        self.on_lost: Callable[[], None] | None = None  # a response's (see _Wire.when_lost)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow._is_writable_event = LazyEvent(is_set=True)  # as uvicorn makes it, writable
        limits = self.limits
        open_now = len(self.connections)  # this one included
        if open_now > limits.overflow:
            limits.count("overflow")
            log.debug("closed a new connection: %d open", open_now)
            transport.close()
            return
        address = self.client[0] if self.client is not None else None
        refusal: Callable[[Scope, Receive, Send], Any] | None = None
        if address is not None and limits.per_address and not limits.uncapped(address):
            # Counted from the first moment, refused or not: each holds a descriptor.
            addresses = limits.shares.addresses
            held = addresses[address] = addresses.get(address, 0) + 1
            self._address = address
            if held > limits.address_overflow:
                limits.count("address_overflow")
                log.debug("closed a new connection: %d open from its address", held)
                transport.close()
                return
            if held > limits.per_address:
                refusal = self._refuse_address  # its request, once in, gets the 429
        if refusal is None and open_now > limits.max_connections:
            refusal = self._refuse  # its request, once the headers are in, gets the 503
        if refusal is not None:
            self.app = refusal
        _limit_unsent(transport)
        self._arm(limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._let_go()
        if self._address is not None:
            _give_back(self.limits.shares.addresses, self._address)
            self._address = None
        super().connection_lost(exc)
        self.lost = True
        callback, self.on_lost = self.on_lost, None
        if callback is not None:
            callback()
        for cycle in (self.cycle, *(queued for queued, _ in self.pipeline)):
            if cycle is None:
                continue
            for handle in (cycle.scope.get(WIRE), cycle.scope.get(SHARE)):
                if isinstance(handle, (_Wire, _Share)):
                    handle.cut()

    def data_received(self, data: bytes) -> None:
        phase = self._phase
        if phase is _Phase.CLOSING:
            return
        if phase is _Phase.REQUEST and self._deadline is None and self._idle():
            # Bytes on a kept-alive connection start the next request's header clock, whether
            # or not the parser sees a request begin: it skips stray line ends without one,
            # and any byte cancels uvicorn's keep-alive timer, so "\r\n" now and then would
            # otherwise hold the connection for ever.
            self._phase = phase = _Phase.FRESH
            self._header_bytes = 0
            self._arm(self.limits.header_timeout_s)
        counted = phase in (_Phase.FRESH, _Phase.HEADERS)
        super().data_received(data)
        if self._phase is _Phase.BODY and self._deadline is None:
            self._arm(self.limits.body_timeout_s)  # the body's clock, from its headers' end
        if not counted or self._phase not in _HEADER_PHASES or self.transport.is_closing():
            return
        # The request's headers are still incomplete after this chunk: the parser holds them.
        self._header_bytes += len(data)
        if self._header_bytes > self.limits.max_header_bytes:
            self.limits.count("headers_too_large")
            limit = self.limits.max_header_bytes
            message = f"request line and headers are larger than {limit} bytes"
            self._answer_and_close(json_error(431, "headers_too_large", message))

    def _idle(self) -> bool:
        """Whether no request is under way: the last one's response is complete."""
        return self.cycle is None or self.cycle.response_complete

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _Phase.HEADERS
        self._header_bytes = 0
        if self._deadline is None:  # a later request on a kept-alive connection
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._phase = _Phase.BODY  # until on_message_complete (at once for a request without)
        target = self.url
        if len(target) <= URL_PARSER_MAX:
            super().on_headers_complete()
            if "path" not in self.scope:  # an upgrade, which uvicorn hands on as it came
                self._phase = _Phase.REQUEST
                return
            self._offer_handles()
            return
        # Too long for httptools.parse_url: let uvicorn build the request on a stand-in, then
        # put the real path and query in its scope (the request's task has not run yet).
        self.url = b"/"
        super().on_headers_complete()
        if "path" not in self.scope:  # an upgrade, which uvicorn hands on as it came
            self._phase = _Phase.REQUEST
            return
        raw_path, _, query = target.partition(b"#")[0].partition(b"?")
        self.scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        self.scope["path"] = self.root_path + unquote(raw_path.decode("latin-1"))
        self.scope["query_string"] = query
        self._offer_handles()

    def on_message_complete(self) -> None:
        if self._phase is _Phase.BODY:
            self._disarm()
            self._phase = _Phase.REQUEST
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._let_go()  # before the next pipelined request starts
        super().on_response_complete()

    def _offer_handles(self) -> None:
        """Put the request's wire and share in its scope, and give it an event that waits for
        nothing until someone waits (its task has not run yet: nobody waits on uvicorn's)."""
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # (not an upgrade)
            self.scope[WIRE] = _Wire(self, cycle)  # type: ignore[typeddict-unknown-key]
            if self.limits.per_tenant:
                self.scope[SHARE] = _Share(self, cycle)  # type: ignore[typeddict-unknown-key]
            cycle.message_event = LazyEvent(is_set=cycle.message_event.is_set())

    def hold(self, share: _Share, tenant: str) -> bool:
        """Count ``share``'s request against ``tenant`` (see :class:`_Share`); False, counted
        as a refusal, when the tenant holds its whole share already."""
        if share.tenant is not None:
            return True  # counted already (a second look at the same caller)
        limits = self.limits
        tenants = limits.shares.tenants
        held = tenants.get(tenant, 0)
        if held >= limits.per_tenant:
            limits.refused("tenant")
            return False
        self._let_go()  # (a request holds one place at a time: none is held here)
        tenants[tenant] = held + 1
        share.tenant, self._held = tenant, share
        return True

    def _let_go(self) -> None:
        """Give back the place the request under way holds in its tenant's share, if any."""
        share, self._held = self._held, None
        if share is not None and share.tenant is not None:
            _give_back(self.limits.shares.tenants, share.tenant)
            share.tenant = None

    def _answer_and_close(self, response: bytes) -> None:
        """Send ``response``, then drop what the client still sends until it stops or LINGER_S.

        Closing a socket that has unread bytes resets it, which can destroy the answer in flight.
        """
        self._disarm()
        self._phase = _Phase.CLOSING
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then an end of stream
        self._deadline = self.loop.call_later(LINGER_S, self._close)

    def _close(self) -> None:
        """Close the connection; abort it if what it still has to send is not gone within
        CLOSE_GRACE_S (a close waits for the client to take it, and one may never)."""
        self._disarm()
        self._phase = _Phase.CLOSING
        self.transport.close()
        if not self.lost:
            self._deadline = self.loop.call_later(CLOSE_GRACE_S, self.abort)

    def abort(self) -> None:
        """Drop the connection now, and whatever it has unsent: the client's side is reset,
        and the descriptor closed, whether or not the client reads."""
        if self.lost:
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
            except OSError as exc:  # (closed already) the abort below still frees it
                log.debug("SO_LINGER not set: %s", exc)
        self.transport.abort()

    def _arm(self, timeout_s: float) -> None:
        self._deadline = self.loop.call_later(timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        phase = self._phase
        if phase in (_Phase.REQUEST, _Phase.CLOSING) or self.lost:
            return
        limits = self.limits
        if phase is _Phase.BODY:
            if self.pipeline:  # its body waits behind the request before it (reading paused)
                self._arm(limits.body_timeout_s)
                return
            limits.count("body_timeout")
            cycle = self.cycle
            if cycle is not None and not cycle.response_started and not cycle.disconnected:
                message = f"the request body did not arrive within {limits.body_timeout_s:g} s"
                self.transport.write(json_error(408, "request_timeout", message))
        else:
            limits.count("header_timeout")
            if phase is _Phase.HEADERS:
                message = f"request headers did not arrive within {limits.header_timeout_s:g} s"
                self.transport.write(json_error(408, "request_timeout", message))
        self._close()

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app of a connection opened past ``BROKER_MAX_CONNECTIONS``."""
        self.limits.count("over_limit")
        message = (
            f"this broker process serves at most {self.limits.max_connections} connections; "
            "retry shortly"
        )
        await _send_refusal(send, 503, "too_many_connections", message)

    async def _refuse_address(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app of a connection opened past its address's share."""
        self.limits.refused("address")
        message = (
            f"this address has {self.limits.per_address} connections open to this broker "
            "process, as many as it may (BROKER_MAX_CONNECTIONS_PER_ADDRESS); retry when one "
            "has closed"
        )
        await _send_refusal(send, 429, CALLER_REFUSAL, message)


_HEADER_PHASES = (_Phase.FRESH, _Phase.HEADERS)


async def _send_refusal(send: Send, status: int, code: str, message: str) -> None:
    """A refusal of this protocol's own, with ``Retry-After``, that closes the connection."""
    body = orjson.dumps({"error": {"code": code, "message": message}})
    retry_after = REFUSAL_RETRY_AFTER_S if status == 503 else CALLER_RETRY_AFTER_S
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(retry_after).encode()),
                (b"connection", b"close"),
                *COMMON,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _limit_unsent(transport: asyncio.BaseTransport) -> None:
    """Bound what the kernel and the transport queue unsent on this connection (see above)."""
    if isinstance(transport, asyncio.WriteTransport):
        transport.set_write_buffer_limits(high=UNSENT_LIMIT)
    sock = transport.get_extra_info("socket")
    if (
        _NOTSENT_LOWAT is None
        or sock is None
        or sock.family not in (socket.AF_INET, socket.AF_INET6)
    ):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _NOTSENT_LOWAT, UNSENT_LIMIT)
    except OSError as exc:  # a platform without it: flow control then starts at the kernel's
        log.debug("TCP_NOTSENT_LOWAT not set: %s", exc)


def guarded(limits: ConnectionLimits) -> type[GuardedHttpProtocol]:
    """The protocol class for a server with ``limits`` (uvicorn's ``http=``)."""

    class Guarded(GuardedHttpProtocol):
        __slots__ = ()

    Guarded.limits = limits
    return Guarded
