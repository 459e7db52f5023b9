"""The fast path, in one room: the HTTP protocol, the event streams' wire and the Redis pools
that reach past uvicorn's and redis-py's public interfaces, and the way back to both.

The assembly asks :func:`probe` once at start-up (``BROKER_FAST_PATH``: ``auto``, the default,
or ``off``). Each half runs only while every private name it needs is present on the installed
releases; otherwise, or with ``off``, the process serves with stock parts and logs one line:

* HTTP: :class:`FastHttpProtocol` (uvicorn's httptools protocol, subclassed, with a
  :class:`ConnectionWire` per request) or :class:`StockHttpProtocol` (uvicorn's own protocol,
  wrapped through ``asyncio``'s public protocol interface). Both hold the same
  :class:`ConnectionLimits`: header and body deadlines, the connection cap, each address's and
  tenant's share, the header size cap, closes that finish.
* Redis: the fast pools of :mod:`broker.fastpath.redis_pool`, or redis-py's ``ConnectionPool``
  and a bounded ``BlockingConnectionPool`` (:func:`make_pool`).

Every private name touched, per library, as of the releases the fast path was written against
(uvicorn 0.54, redis-py 8.1; ``tests/test_fastpath_contract.py`` holds each):

uvicorn 0.54 (``uvicorn.protocols.http``):
  * ``httptools_impl.HttpToolsProtocol``, subclassed: the parser callbacks ``on_message_begin``,
    ``on_headers_complete``, ``on_message_complete``, ``on_response_complete``, and
    ``send_400_response`` (answered in the broker's error shape instead); the attributes
    ``pipeline`` (replaced by a list: uvicorn uses ``appendleft``, ``pop`` and its truth),
    ``cycle``, ``scope``, ``url``, ``root_path``, ``client``, ``connections``, ``flow``,
    ``transport``, ``loop``, ``app`` (set to a refusal), and the ``_loop`` argument (tests).
  * ``httptools_impl.RequestResponseCycle``: ``transport`` (written to, and swapped for a moment
    to hold a response's head), ``chunked_encoding``, ``response_complete``,
    ``response_started``, ``disconnected``, ``flow``, ``message_event`` (replaced by a
    ``LazyEvent``, which makes its ``asyncio.Event`` on the first wait), ``scope``.
  * ``flow_control.FlowControl``: ``_is_writable_event`` (replaced by a ``LazyEvent``),
    ``write_paused``.
redis-py 8.1 (``redis.asyncio.connection``):
  * ``ConnectionPool._available_connections`` (a list, most recently released last, popped from
    the end; replaced by an :class:`IdleStack`, trimmed in place), ``._in_use_connections``,
    and the untyped ``get_available_connection``, ``ensure_connection``,
    ``maint_notifications_enabled``.
  * ``BlockingConnectionPool._condition`` (a return notifies it when a take waits),
    ``can_get_connection``.
  * ``AbstractConnection._writer`` (an ``asyncio.StreamWriter``; before Python 3.12 only, where
    ``asyncio.wait_for`` makes a task of its own), ``should_reconnect``, ``check_health``.

Which rooms may import it: it is on the ground floor (it imports only the ground floor:
``broker.sse`` for the wire's scope key); the assembly wires it in (``broker.app``), and
``broker.connection`` builds its pools with it. Nothing else reaches past a library.
"""

import asyncio

from broker.fastpath.limits import (
    CALLER_REFUSAL,
    CALLER_RETRY_AFTER_S,
    CLOSE_GRACE_S,
    SHARE,
    UNSENT_LIMIT,
    CallerShares,
    ConnectionLimits,
    Share,
    uncapped_addresses,
)
from broker.fastpath.names import NAMES, FastPath, PrivateName, probe
from broker.fastpath.redis_pool import drop_idle, make_pool, trim_idle
from broker.fastpath.stock_protocol import StockHttpProtocol, stock_protocol

__all__ = [
    "CALLER_REFUSAL",
    "CALLER_RETRY_AFTER_S",
    "CLOSE_GRACE_S",
    "NAMES",
    "SHARE",
    "UNSENT_LIMIT",
    "CallerShares",
    "ConnectionLimits",
    "FastPath",
    "PrivateName",
    "Share",
    "StockHttpProtocol",
    "drop_idle",
    "http_protocol_class",
    "make_pool",
    "probe",
    "stock_protocol",
    "trim_idle",
    "uncapped_addresses",
]


def http_protocol_class(limits: ConnectionLimits, *, fast: bool) -> type[asyncio.Protocol]:
    """The protocol class for a server with ``limits`` (uvicorn's ``http=``): the fast one, or
    uvicorn's own behind the same limits. The fast one is imported only when asked for (it
    needs httptools)."""
    if not fast:
        return stock_protocol(limits)
    from broker.fastpath.http_protocol import fast_protocol

    return fast_protocol(limits)
