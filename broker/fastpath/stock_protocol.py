"""The way back: uvicorn's own HTTP protocol, with the same limits per connection.

:class:`StockHttpProtocol` is an ``asyncio.Protocol`` that wraps the protocol uvicorn picks by
itself (``AutoHTTPProtocol``: httptools, else h11) and touches nothing of it but what any
``asyncio`` transport and protocol offer, plus the ASGI scope and messages. It holds the same
limits as the fast protocol (:class:`broker.fastpath.limits.ConnectionLimits`):

* **The connection cap and each address's share**, decided when the connection is made: past
  the overflow it is closed at once; past the cap (or its address's share) its request is
  answered 503 (or 429) with ``Retry-After`` by an app of its own, and the connection closed.
* **The header deadline and size cap**, from the bytes as they come: armed when the connection
  opens and when a byte arrives on a kept-alive connection with no request under way; met when
  a request's head ends (``CRLF CRLF``, after any stray line ends); past it a 408 (when part of
  a request was sent) and the close; past the size cap a 431 and a close that reads and drops
  what follows for a moment.
* **The body deadline**, at the ASGI layer: armed when a request with a body reaches the app,
  met when the app has received the body's last part or the next request begins; past it a 408
  unless the response started, and the close.
* **Targets past httptools' URL parser** (64 KiB): uvicorn's parser is given a stand-in path,
  and the real one is put back in the scope, so the app answers them with its JSON 431.
* **Bytes that are not HTTP/1.1**: uvicorn's own plain-text 400 (written while its parser
  reads them) becomes the broker's JSON error, counted as ``invalid_http``.
* **Each tenant's share**: a request's :class:`broker.fastpath.limits.Share` in its scope,
  given back when its response completes, when its app returns, or when the connection is
  lost (whichever is first).
* **Closes that finish**: any close of the connection (its own, or uvicorn's) becomes an abort
  (``SO_LINGER`` zero) after ``CLOSE_GRACE_S`` if the connection is still open.

It offers no :class:`broker.sse.Wire`: event streams write through ASGI and wait for
``http.disconnect`` with a task of their own, and a stream whose client stopped reading ends at
its send timeout with uvicorn's close, which the grace above turns into an abort.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import copy
import enum
import logging
import weakref
from typing import Any, ClassVar, cast
from urllib.parse import unquote

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.auto import AutoHTTPProtocol
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

log = logging.getLogger("broker.connections")

# The connection whose bytes are being parsed: the request tasks uvicorn starts meanwhile copy
# it (a task takes the context it was created in), so the ASGI layer knows its connection.
_CONNECTION: contextvars.ContextVar[StockHttpProtocol | None] = contextvars.ContextVar(
    "broker_connection", default=None
)
_HEAD_END = b"\r\n\r\n"
# httptools.parse_url keeps offsets in 16 bits: a longer target is handed to uvicorn's parser as
# this path, and put back in the request's scope before the app sees it.
URL_PARSER_MAX = 0xFFFF
_STAND_IN = b"/.broker-long-target"


class _Phase(enum.Enum):
    FRESH = "fresh"  # connection open (or bytes on a kept-alive one), no request begun yet
    HEADERS = "headers"  # a request has begun; its head has not ended
    REQUEST = "request"  # the head is in (then keep-alive)
    BODY = "body"  # the app has the request; its body is still coming
    CLOSING = "closing"  # answered by this protocol; the rest is dropped


async def _through_connection(scope: Scope, receive: Receive, send: Send) -> None:
    """The app uvicorn's protocol runs: its connection's :meth:`StockHttpProtocol.serve`."""
    connection = _CONNECTION.get()
    if connection is None:  # (a task uvicorn started outside data_received: none does)
        raise RuntimeError("a request arrived outside its connection")
    await connection.serve(scope, receive, send)


_INNER_CONFIGS: weakref.WeakKeyDictionary[Config, Config] = weakref.WeakKeyDictionary()


def _inner_config(config: Config) -> Config:
    """``config`` with ``_through_connection`` as its app, for the wrapped protocols."""
    inner = _INNER_CONFIGS.get(config)
    if inner is None:
        inner = copy.copy(config)
        inner.loaded_app = _through_connection
        _INNER_CONFIGS[config] = inner
    return inner


class _Transport(asyncio.Transport):
    """The connection's transport as uvicorn's protocol sees it: every close arms the abort
    that ends a close the client never lets finish."""

    def __init__(self, transport: asyncio.Transport, connection: StockHttpProtocol) -> None:
        super().__init__()
        self._transport = transport
        self._connection = connection

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._connection.parsing and bytes(data[:13]) == b"HTTP/1.1 400 ":
            # uvicorn's own answer to bytes its parser refused (the app writes only from its
            # tasks, never while the bytes are parsed): the broker's JSON 400 instead.
            self._connection.limits.count("invalid_http")
            data = invalid_http()
        self._transport.write(data)

    def close(self) -> None:
        self._transport.close()
        self._connection.closing()

    def abort(self) -> None:
        self._connection.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def write_eof(self) -> None:
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()


class _Place:
    """One request's :class:`broker.fastpath.limits.Share` on the stock protocol."""

    __slots__ = ("_connection", "over", "tenant")

    def __init__(self, connection: StockHttpProtocol) -> None:
        self._connection = connection
        self.tenant: str | None = None  # set while the request is counted
        self.over = False  # the response completed, or the connection went

    def hold(self, tenant: str) -> bool:
        if self.over or self._connection.lost:
            return True  # over already: there is nothing left to count
        return self._connection.hold(self, tenant)


class StockHttpProtocol(asyncio.Protocol):
    """uvicorn's own protocol behind the limits above; bind limits with :func:`stock_protocol`."""

    limits: ClassVar[ConnectionLimits]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.loop = _loop or asyncio.get_event_loop()
        self.app: ASGIApp = config.loaded_app
        self.connections = server_state.connections
        extra = {} if _loop is None else {"_loop": _loop}  # (a test's clock)
        protocol_class = cast(Any, AutoHTTPProtocol)
        self.inner: asyncio.Protocol = protocol_class(
            config=_inner_config(config), server_state=server_state, app_state=app_state, **extra
        )
        self.transport: asyncio.Transport | None = None  # as uvicorn's protocol sees it
        self._raw: asyncio.Transport | None = None  # the connection's own
        self._phase = _Phase.FRESH
        self._header_bytes = 0
        self._tail = b""
        self._line: bytes | None = None  # a request line still coming (None: passed on)
        self._targets: collections.deque[bytes] = collections.deque()  # long ones, in order
        self._deadline: asyncio.TimerHandle | None = None
        self._grace: asyncio.TimerHandle | None = None  # the abort of a close that lingers
        self._address: str | None = None  # counted in the shares' addresses while open
        self._held: _Place | None = None  # the request counted against its tenant
        self._responding = 0  # requests whose head arrived and whose response is not complete
        self._started = False  # the latest request's response has started
        self._dropped = False  # closed at once: past the overflow
        self.parsing = False  # uvicorn's protocol is reading bytes (its writes are its own)
        self.lost = False

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raw = self._raw = cast(asyncio.Transport, transport)
        self.transport = _Transport(raw, self)
        self.inner.connection_made(self.transport)
        limits = self.limits
        open_now = len(self.connections)  # this one included (uvicorn's protocol added it)
        if open_now > limits.overflow:
            limits.count("overflow")
            log.debug("closed a new connection: %d open", open_now)
            self._dropped = True
            raw.close()
            return
        peer = raw.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else None
        refusal: ASGIApp | None = None
        if address is not None and limits.per_address and not limits.uncapped(address):
            addresses = limits.shares.addresses
            held = addresses[address] = addresses.get(address, 0) + 1
            self._address = address
            if held > limits.address_overflow:
                limits.count("address_overflow")
                log.debug("closed a new connection: %d open from its address", held)
                self._dropped = True
                raw.close()
                return
            if held > limits.per_address:
                refusal = self._refuse_address
        if refusal is None and open_now > limits.max_connections:
            refusal = self._refuse
        if refusal is not None:
            self.app = refusal
        limit_unsent(raw)
        self._arm(limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self.lost = True
        self._let_go()
        if self._address is not None:
            give_back(self.limits.shares.addresses, self._address)
            self._address = None
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._dropped or self._phase is _Phase.CLOSING:
            return
        if self._phase is _Phase.REQUEST and self._deadline is None and not self._responding:
            # Bytes on a kept-alive connection start the next request's header clock, whether
            # or not a request begins: stray line ends would otherwise hold it for ever.
            self._phase, self._header_bytes, self._tail = _Phase.FRESH, 0, b""
            self._arm(self.limits.header_timeout_s)
        if self._phase in (_Phase.FRESH, _Phase.HEADERS) and not self._read_head(data):
            return
        if self._line is not None:
            data = self._request_line(data)
            if not data:
                return
        token = _CONNECTION.set(self)
        self.parsing = True
        try:
            self.inner.data_received(data)
        finally:
            self.parsing = False
            _CONNECTION.reset(token)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # --- the head, from the bytes ---------------------------------------------------------

    def _read_head(self, data: bytes) -> bool:
        """Follow a request's head through ``data``: its start, its end, its size; False when
        the head is past the size cap (answered 431: ``data`` goes no further)."""
        if self._phase is _Phase.FRESH:
            data = data.lstrip(b"\r\n")  # line ends before a request begin none
            if not data:
                return True
            self._phase, self._header_bytes, self._tail = _Phase.HEADERS, 0, b""
            self._line = b""
        window = self._tail + data
        end = window.find(_HEAD_END)
        if end >= 0:
            self._disarm()
            self._phase = _Phase.REQUEST
            self._responding += 1  # (its app has not run yet: bytes that follow are its body)
            return True
        self._tail = window[-3:]
        self._header_bytes += len(data)
        limits = self.limits
        if self._header_bytes > limits.max_header_bytes:
            limits.count("headers_too_large")
            message = f"request line and headers are larger than {limits.max_header_bytes} bytes"
            self._answer_and_close(json_error(431, "headers_too_large", message, limits.headers))
            return False
        return True

    def _request_line(self, data: bytes) -> bytes:
        """What uvicorn's parser is given of ``data``: nothing while the request line is
        incomplete, then the line (its target replaced if too long) and what follows it."""
        line = (self._line or b"") + data
        end = line.lstrip(b"\r\n").find(b"\n")
        if end < 0:
            self._line = line
            return b""
        self._line = None
        line = line.lstrip(b"\r\n")
        first, rest = line[: end + 1], line[end + 1 :]
        parts = first.split(b" ")
        if len(parts) == 3 and len(parts[1]) > URL_PARSER_MAX:
            self._targets.append(parts[1])
            first = b" ".join((parts[0], _STAND_IN, parts[2]))
        return first + rest

    # --- the ASGI layer -------------------------------------------------------------------

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app for one request, with its body deadline and its tenant's share."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._started = False
        if self._targets and scope.get("raw_path", b"").endswith(_STAND_IN):
            _restore_target(scope, self._targets.popleft())
        if self._phase is _Phase.BODY:  # the request before's body ended: this one began
            self._disarm()
            self._phase = _Phase.REQUEST
        place = _Place(self) if self.limits.per_tenant else None
        if place is not None:
            scope[SHARE] = place
        done = False

        def complete() -> None:
            nonlocal done
            if not done:
                done = True
                # (floored: pipelined heads in one chunk are seen as one)
                self._responding = max(0, self._responding - 1)
                if place is not None:
                    place.over = True
                    if self._held is place:
                        self._let_go()

        async def through(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._started = True
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete()

        try:
            if _has_body(scope) and not self.lost and self._phase is _Phase.REQUEST:
                self._phase = _Phase.BODY
                self._disarm()
                self._arm(self.limits.body_timeout_s)
                await self.app(scope, self._receiving(receive), through)
            else:
                await self.app(scope, receive, through)
        finally:
            complete()

    def _receiving(self, receive: Receive) -> Receive:
        """``receive``, meeting the body deadline once the body's last part is received."""

        async def received() -> Message:
            message = await receive()
            ended = message["type"] == "http.request" and not message.get("more_body", False)
            if ended and self._phase is _Phase.BODY:
                self._disarm()
                self._phase = _Phase.REQUEST
            return message

        return received

    def hold(self, place: _Place, tenant: str) -> bool:
        """Count ``place``'s request against ``tenant``; False, counted as a refusal, when the
        tenant holds its whole share already."""
        if place.tenant is not None:
            return True  # counted already (a second look at the same caller)
        limits = self.limits
        tenants = limits.shares.tenants
        held = tenants.get(tenant, 0)
        if held >= limits.per_tenant:
            limits.refused("tenant")
            return False
        self._let_go()  # (a request holds one place at a time)
        tenants[tenant] = held + 1
        place.tenant, self._held = tenant, place
        return True

    def _let_go(self) -> None:
        place, self._held = self._held, None
        if place is not None and place.tenant is not None:
            give_back(self.limits.shares.tenants, place.tenant)
            place.tenant = None

    # --- closes and deadlines -------------------------------------------------------------

    def _answer_and_close(self, response: bytes) -> None:
        """Send ``response``, then drop what the client still sends until LINGER_S."""
        assert self.transport is not None
        self._disarm()
        self._phase = _Phase.CLOSING
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._deadline = self.loop.call_later(LINGER_S, self._close)

    def _close(self) -> None:
        self._disarm()
        self._phase = _Phase.CLOSING
        if self.transport is not None:
            self.transport.close()  # (which arms the abort: see closing)

    def closing(self) -> None:
        """The connection is closing: abort it if it is still open after CLOSE_GRACE_S."""
        if not self.lost and self._grace is None:
            self._grace = self.loop.call_later(CLOSE_GRACE_S, self.abort)

    def abort(self) -> None:
        """Drop the connection now, and whatever it has unsent."""
        raw = self._raw
        if self.lost or raw is None:
            return
        reset_on_close(raw)
        raw.abort()

    def _arm(self, timeout_s: float) -> None:
        self._deadline = self.loop.call_later(timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        phase = self._phase
        if phase in (_Phase.REQUEST, _Phase.CLOSING) or self.lost or self.transport is None:
            return
        limits = self.limits
        if phase is _Phase.BODY:
            limits.count("body_timeout")
            if not self._started:
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


def _restore_target(scope: Scope, target: bytes) -> None:
    """Put a request's real target in its scope, as uvicorn would have."""
    root: str = scope.get("root_path", "")
    raw_path, _, query = target.partition(b"#")[0].partition(b"?")
    scope["raw_path"] = root.encode("ascii") + raw_path
    scope["path"] = root + unquote(raw_path.decode("latin-1"))
    scope["query_string"] = query


def _has_body(scope: Scope) -> bool:
    """Whether a request's headers announce a body."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def stock_protocol(limits: ConnectionLimits) -> type[StockHttpProtocol]:
    """The stock protocol class for a server with ``limits`` (uvicorn's ``http=``)."""

    class ServerProtocol(StockHttpProtocol):
        pass

    ServerProtocol.limits = limits
    return ServerProtocol
