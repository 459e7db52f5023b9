"""The fast HTTP protocol: uvicorn's httptools protocol, with limits per connection and a wire.

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
  aborts its connection at its send timeout (:meth:`ConnectionWire.abort`): a graceful close
  waits for a client that reads nothing for ever, socket and descriptor held. An abort sets
  ``SO_LINGER`` to zero, so the kernel drops the unsent bytes and resets the connection at once
  rather than keep it (ESTABLISHED on the client's side) after the descriptor is gone.
* **Each caller's share** (:class:`broker.fastpath.limits.CallerShares`). A client address
  holds at most ``per_address`` connections (addresses for which ``uncapped`` is true aside):
  the connection past it is answered 429 ``too_many_connections_for_caller`` with
  ``Retry-After`` once its request arrives, and a tenth past it is closed at once. A tenant
  has at most ``per_tenant`` requests in flight: each request carries a
  :class:`broker.fastpath.limits.Share` in its scope (``SHARE``), which the app holds for the
  request's tenant once its credentials are checked (``routes.authenticate``). The place is
  given back by the connection, when the response completes or the connection is lost: never
  by the request's task, which a cancellation lost in redis-py could keep running.
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
  opening frame and the replay at hand are one write (what a write costs an attach:
  ``benchmarks/RESULTS.md``).
* **Less memory per connection**, for a process that holds ten thousand: uvicorn's two events
  per connection (the request's and the flow control's) get their waiters' queue only once
  someone waits (:class:`LazyEvent`), and its queue of pipelined requests is a list: an empty
  ``collections.deque`` is several times a list's size (figures: ``benchmarks/RESULTS.md``).
* **A bound on what is queued unsent** per connection: ``UNSENT_LIMIT`` in the kernel
  (``TCP_NOTSENT_LOWAT``, where the platform has it) and as the transport's high-water mark.
  Without it the kernel grows a connection's send buffer towards ``net.ipv4.tcp_wmem``
  (megabytes) for a client that reads nothing: such a client looks like a
  fast one, and its reader does the work of megabytes of events before any write waits. With it,
  a write waits after a few tens of KiB, so a response's flow control (and its send timeout)
  sees a slow client at once, and its reader stops reading Redis for it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from typing import Any, ClassVar
from urllib.parse import unquote

from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from broker.fastpath.limits import (
    CALLER_REFUSAL,
    CLOSE_GRACE_S,
    LINGER_S,
    SHARE,
    ConnectionLimits,
    address_message,
    give_back,
    invalid_http,
    json_error,
    limit_unsent,
    over_limit_message,
    reset_on_close,
    send_refusal,
)
from broker.fastpath.wire import ConnectionWire, LazyEvent, PipelineQueue, TenantPlace
from broker.sse import WIRE

log = logging.getLogger("broker.connections")

# httptools.parse_url keeps offsets in 16 bits: a longer URL is refused with a parser error.
URL_PARSER_MAX = 0xFFFF


class _Phase(enum.Enum):
    FRESH = "fresh"  # connection open (or bytes on a kept-alive one), no request begun yet
    HEADERS = "headers"  # a request has begun; its headers are not complete
    BODY = "body"  # headers complete: the app has the request; its body is still coming
    REQUEST = "request"  # the whole request arrived (then keep-alive)
    CLOSING = "closing"  # answered by this protocol; the rest of the request is dropped


class FastHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above; bind limits with :func:`fast_protocol`.

    Its own state is in slots: uvicorn's protocol sets many attributes, and an instance
    dictionary with more than 30 keys stops sharing its keys with the class's other instances,
    which made each connection's dictionary several times larger.
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
        self.pipeline = PipelineQueue()  # type: ignore[assignment]
        self._phase = _Phase.FRESH
        self._header_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._address: str | None = None  # counted in the shares' addresses while open
        self._held: TenantPlace | None = None  # the request counted against its tenant
        self.lost = False  # the connection is lost
        # A response's (see ConnectionWire.when_lost).
        self.on_lost: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # As uvicorn makes it, writable (duck-typed: uvicorn calls set, clear and wait only).
        self.flow._is_writable_event = LazyEvent(is_set=True)  # type: ignore[assignment]
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
        limit_unsent(transport)
        self._arm(limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._let_go()
        if self._address is not None:
            give_back(self.limits.shares.addresses, self._address)
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
                if isinstance(handle, (ConnectionWire, TenantPlace)):
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
            answer = json_error(431, "headers_too_large", message, self.limits.headers)
            self._answer_and_close(answer)

    def send_400_response(self, msg: str) -> None:
        """The parser refused the bytes (uvicorn logged it): the broker's JSON 400, not
        uvicorn's plain text, and the close."""
        self.limits.count("invalid_http")
        self._answer_and_close(invalid_http())

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
            self.scope[WIRE] = ConnectionWire(self, cycle)  # type: ignore[typeddict-unknown-key]
            if self.limits.per_tenant:
                self.scope[SHARE] = TenantPlace(self, cycle)  # type: ignore[typeddict-unknown-key]
            cycle.message_event = LazyEvent(is_set=cycle.message_event.is_set())  # type: ignore[assignment]

    def hold(self, share: TenantPlace, tenant: str) -> bool:
        """Count ``share``'s request against ``tenant`` (see :class:`TenantPlace`); False, counted
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
            give_back(self.limits.shares.tenants, share.tenant)
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
        reset_on_close(self.transport)
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
                self.transport.write(json_error(408, "request_timeout", message, limits.headers))
        else:
            limits.count("header_timeout")
            if phase is _Phase.HEADERS:
                message = f"request headers did not arrive within {limits.header_timeout_s:g} s"
                self.transport.write(json_error(408, "request_timeout", message, limits.headers))
        self._close()

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app of a connection opened past ``BROKER_MAX_CONNECTIONS``."""
        self.limits.count("over_limit")
        message = over_limit_message(self.limits)
        await send_refusal(send, 503, "too_many_connections", message, self.limits.headers)

    async def _refuse_address(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app of a connection opened past its address's share."""
        self.limits.refused("address")
        message = address_message(self.limits)
        await send_refusal(send, 429, CALLER_REFUSAL, message, self.limits.headers)


_HEADER_PHASES = (_Phase.FRESH, _Phase.HEADERS)


def fast_protocol(limits: ConnectionLimits) -> type[FastHttpProtocol]:
    """The fast protocol class for a server with ``limits`` (uvicorn's ``http=``)."""

    class ServerProtocol(FastHttpProtocol):
        __slots__ = ()

    ServerProtocol.limits = limits
    return ServerProtocol
