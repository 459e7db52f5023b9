"""The limits one server applies to each connection, shared by both HTTP protocols.

:class:`ConnectionLimits` is what the assembly hands to :func:`broker.fastpath.http_protocol_class`;
both the fast protocol and the stock one enforce it (see the package's docstring). Nothing here
touches a library's private name: these are the answers both write (a JSON error, a refusal
with ``Retry-After``), the counts of each caller's share, and the socket options both set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http
import ipaddress
import logging
import socket
import struct
from collections.abc import Callable
from typing import Final, Protocol

import orjson
from starlette.types import Send

log = logging.getLogger("broker.connections")

SHARE: Final = "broker.share"  # the scope key of the request's Share, when the server has one
# The code of a 429 for a caller past its share (an address's or a tenant's).
CALLER_REFUSAL: Final = "too_many_connections_for_caller"
CALLER_RETRY_AFTER_S: Final = 1
REFUSAL_RETRY_AFTER_S: Final = 1
# How long a connection answered 431 mid-request is still read (and dropped) before the close.
LINGER_S: Final = 2.0
# How long a close a protocol began may wait for its unsent bytes before the connection is
# aborted (a client that reads nothing would hold a graceful close open for ever).
CLOSE_GRACE_S: Final = 2.0
# SO_LINGER on, with no time: the close of an aborted socket resets the connection at once and
# drops what is unsent, where the kernel would otherwise keep trying to send it (the client's
# side stays ESTABLISHED for as long) after the descriptor is gone.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
# Bytes the kernel, and the transport, may each hold unsent per connection (more may be in
# flight, as the client's window allows): enough to keep a client's link busy between two
# writes of the event loop, little for one that reads nothing.
UNSENT_LIMIT: Final = 16_384
_NOTSENT_LOWAT: int | None = getattr(socket, "TCP_NOTSENT_LOWAT", None)


class Share(Protocol):
    """A request's place in its tenant's share of the process's connections, offered by the
    server (``scope[SHARE]``, see :mod:`broker.fastpath`)."""

    def hold(self, tenant: str) -> bool:
        """Count the request against ``tenant`` until it ends (its response complete, or its
        connection lost, however it ends); False when the tenant's share is all taken."""
        ...


def _uncounted(reason: str) -> None:
    """The default counter: counts nothing."""


def _capped_nowhere(address: str) -> bool:
    return False


class CallerShares:
    """What each caller holds of one server's connections: open connections per client
    address, and requests in flight per tenant. Each count goes as its connection or request
    ends; a key at zero is removed."""

    __slots__ = ("addresses", "tenants")

    def __init__(self) -> None:
        self.addresses: dict[str, int] = {}
        self.tenants: dict[str, int] = {}


def give_back(table: dict[str, int], key: str) -> None:
    """One less held by ``key`` in ``table``; a key at zero is removed."""
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
    # Headers every answer of the protocol's own carries (the app's security headers).
    headers: tuple[tuple[bytes, bytes], ...] = ()

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


# The answer to bytes that are not an HTTP/1.1 request (either protocol's parser refused them).
INVALID_HTTP = (
    "the request is not valid HTTP/1.1: its request line, a header or the body's framing could "
    "not be parsed"
)


def invalid_http() -> bytes:
    """The broker's 400 for bytes its HTTP parser refused, in place of uvicorn's plain text."""
    return json_error(400, "bad_request", INVALID_HTTP)


def json_error(
    status: int, code: str, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> bytes:
    """A whole HTTP/1.1 response with the broker's error body, that closes the connection."""
    body = orjson.dumps({"error": {"code": code, "message": message}})
    lines = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode(),
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
        *(name + b": " + value for name, value in headers),
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def send_refusal(
    send: Send, status: int, code: str, message: str, headers: tuple[tuple[bytes, bytes], ...]
) -> None:
    """A refusal of a protocol's own, with ``Retry-After``, that closes the connection."""
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
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def over_limit_message(limits: ConnectionLimits) -> str:
    return f"this broker process serves at most {limits.max_connections} connections; retry shortly"


def address_message(limits: ConnectionLimits) -> str:
    return (
        f"this address has {limits.per_address} connections open to this broker "
        "process, as many as it may (BROKER_MAX_CONNECTIONS_PER_ADDRESS); retry when one "
        "has closed"
    )


def limit_unsent(transport: asyncio.BaseTransport) -> None:
    """Bound what the kernel and the transport queue unsent on this connection: a write then
    waits after a few tens of KiB, so flow control sees a client that reads nothing at once."""
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


def reset_on_close(transport: asyncio.BaseTransport) -> None:
    """Set ``SO_LINGER`` to zero, so that closing the socket resets the connection at once."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        except OSError as exc:  # (closed already) the abort that follows still frees it
            log.debug("SO_LINGER not set: %s", exc)
