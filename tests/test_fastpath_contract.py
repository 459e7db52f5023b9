"""The private names the fast path touches, held to what it does with them, on the installed
releases; and the probe that turns the fast path off when one is gone.

A release of uvicorn, redis-py or Python that renames or reshapes one of these fails here with a
message naming the name and the release; the broker itself would start on stock parts (the
probe), so the failure says what to port, not that anything is broken for users.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import re
from typing import Any

import httpx
import pytest
import uvicorn
from redis.asyncio import BlockingConnectionPool, ConnectionPool
from redis.asyncio.connection import AbstractConnection
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from broker.connection import client
from broker.fastpath import NAMES, PrivateName, StockHttpProtocol, probe
from broker.fastpath import names as probe_module
from broker.fastpath.http_protocol import FastHttpProtocol
from broker.fastpath.names import FastPath, version
from broker.fastpath.redis_pool import FastBlockingPool
from broker.settings import Settings, SettingsError
from tests.conftest import BrokerFactory
from tests.helpers import read_sse, start_turn


def single_node(redis_url: str) -> str:
    """A URL of one server: the first node of a cluster's (the pools below are a single
    server's; a cluster client keeps one per node, and the fast path has none for them)."""
    scheme, sep, rest = redis_url.partition("+cluster://")
    if not sep:
        return redis_url
    return f"{scheme}://{rest.split(',')[0].split('?')[0]}"


def changed(library: str, what: str) -> str:
    """The message of a contract that a release broke."""
    return (
        f"{library} {version(library)}: {what}. The fast path (broker/fastpath) relies on it; "
        "the probe turns it off on this release until it is ported."
    )


# --- every name is still there -------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES, ids=lambda name: f"{name.library}:{name.where}")
def test_each_private_name_is_present(name: PrivateName) -> None:
    assert name.present(), changed(name.library, f"{name.where} ({name.kind}) is gone")


def test_the_probe_finds_the_fast_path_whole_here() -> None:
    assert probe("auto") == FastPath(http=True, redis=True)


# --- and does what the fast path expects of it ----------------------------------------------


class Transport:
    """Enough of a transport for uvicorn's protocol to take a request."""

    def __init__(self) -> None:
        self.written = bytearray()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("10.0.0.1", 40_000), "sockname": ("10.9.9.9", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_uvicorn_flow_control_keeps_its_writable_event() -> None:
    flow = FlowControl(Transport())  # type: ignore[arg-type]
    event = getattr(flow, "_is_writable_event", None)
    assert isinstance(event, asyncio.Event), changed(
        "uvicorn", "FlowControl._is_writable_event is no longer an asyncio.Event"
    )
    assert event.is_set(), changed("uvicorn", "FlowControl._is_writable_event is not set at first")
    assert flow.write_paused is False, changed("uvicorn", "FlowControl.write_paused changed")


def test_uvicorn_uses_only_appendleft_pop_and_truth_of_its_pipeline() -> None:
    uses = set(re.findall(r"self\.pipeline\.(\w+)", inspect.getsource(HttpToolsProtocol)))
    assert uses <= {"appendleft", "pop"}, changed(
        "uvicorn", f"HttpToolsProtocol.pipeline is used with {sorted(uses)} (a list stands in)"
    )


async def test_uvicorn_protocol_and_cycle_have_what_the_fast_protocol_reads() -> None:
    started = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        started.set()

    config = uvicorn.Config(app, http="httptools", lifespan="off")
    config.load()
    protocol = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(Transport())  # type: ignore[arg-type]
    for name in ("flow", "transport", "client", "connections", "loop", "app", "root_path"):
        assert hasattr(protocol, name), changed("uvicorn", f"HttpToolsProtocol.{name} is gone")
    assert isinstance(protocol.pipeline, collections.deque), changed(
        "uvicorn", "HttpToolsProtocol.pipeline is no longer a deque"
    )
    protocol.data_received(b"GET /x?y=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    cycle = protocol.cycle
    assert isinstance(cycle, RequestResponseCycle), changed(
        "uvicorn", "HttpToolsProtocol.cycle is not the request's RequestResponseCycle"
    )
    assert protocol.url == b"/x?y=1", changed("uvicorn", "HttpToolsProtocol.url changed")
    assert cycle.scope is protocol.scope, changed("uvicorn", "the cycle's scope is not the last")
    expected = {
        "transport": protocol.transport,
        "response_complete": False,
        "response_started": False,
        "disconnected": False,
        "flow": protocol.flow,
    }
    for name, value in expected.items():
        assert getattr(cycle, name, object()) is value, changed(
            "uvicorn", f"RequestResponseCycle.{name} is not {value!r} for a fresh request"
        )
    assert hasattr(cycle, "chunked_encoding"), changed(
        "uvicorn", "RequestResponseCycle.chunked_encoding is gone"
    )
    assert isinstance(cycle.message_event, asyncio.Event), changed(
        "uvicorn", "RequestResponseCycle.message_event is not an asyncio.Event"
    )
    await asyncio.wait_for(started.wait(), 5)
    protocol.connection_lost(None)


async def test_uvicorn_answers_bytes_its_parser_refuses_through_send_400_response() -> None:
    """The fast protocol answers them in the broker's error shape by overriding it."""
    asked: list[str] = []

    class Recording(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            asked.append(msg)

    config = uvicorn.Config(lambda *_: None, http="httptools", lifespan="off")
    config.load()
    protocol = Recording(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(Transport())  # type: ignore[arg-type]
    protocol.data_received(b"GET / HTTP/1.1\r\nContent-Length: \r\n\r\n")
    assert len(asked) == 1, changed(
        "uvicorn", "HttpToolsProtocol no longer answers a parser error with send_400_response"
    )


def test_uvicorn_asks_only_what_a_lazy_event_answers_of_its_two_events() -> None:
    """``message_event`` and ``_is_writable_event`` are replaced by a LazyEvent (duck-typed)."""
    from uvicorn.protocols.http import flow_control, httptools_impl

    source = inspect.getsource(httptools_impl) + inspect.getsource(flow_control)
    uses = set(re.findall(r"(?:message_event|_is_writable_event)\.(\w+)", source))
    assert uses <= {"set", "clear", "is_set", "wait"}, changed(
        "uvicorn", f"its request and flow-control events are used with {sorted(uses)}"
    )


async def test_redis_pools_keep_their_idle_list_and_in_use_set(redis_url: str) -> None:
    pool = ConnectionPool.from_url(single_node(redis_url))
    try:
        idle = getattr(pool, "_available_connections", None)
        in_use = getattr(pool, "_in_use_connections", None)
        assert isinstance(idle, list), changed(
            "redis", "ConnectionPool._available_connections is no longer a list"
        )
        assert isinstance(in_use, set), changed(
            "redis", "ConnectionPool._in_use_connections is no longer a set"
        )
        first = await pool.get_connection()  # type: ignore[no-untyped-call]
        second = await pool.get_connection()  # type: ignore[no-untyped-call]
        assert in_use == {first, second}, changed("redis", "_in_use_connections misses a take")
        await pool.release(first)
        await pool.release(second)
        assert idle == [first, second], changed(
            "redis", "a released connection is not appended to _available_connections"
        )
        again = await pool.get_connection()  # type: ignore[no-untyped-call]
        assert again is second, changed(
            "redis", "the pool no longer hands out its most recently released connection first"
        )
    finally:
        await pool.disconnect()


async def test_redis_blocking_pool_and_connection_keep_their_condition_and_writer(
    redis_url: str,
) -> None:
    pool = BlockingConnectionPool.from_url(single_node(redis_url), max_connections=2)
    try:
        assert isinstance(getattr(pool, "_condition", None), asyncio.Condition), changed(
            "redis", "BlockingConnectionPool._condition is no longer an asyncio.Condition"
        )
        connection = await pool.get_connection()  # type: ignore[no-untyped-call]
        assert isinstance(connection, AbstractConnection)
        assert isinstance(getattr(connection, "_writer", None), asyncio.StreamWriter), changed(
            "redis", "a connected AbstractConnection._writer is no longer an asyncio.StreamWriter"
        )
        await pool.release(connection)
    finally:
        await pool.disconnect()


# --- the probe and the way back ---------------------------------------------------------------


MISSING_HTTP = PrivateName(
    "http",
    "uvicorn",
    "uvicorn.protocols.http.httptools_impl:RequestResponseCycle",
    "_gone",
    "attribute",
)
MISSING_REDIS = PrivateName(
    "redis", "redis", "redis.asyncio.connection:ConnectionPool", "_gone", "attribute"
)


@pytest.fixture
def names_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe sees one name of each half gone (as a release that renamed them would show)."""
    monkeypatch.setattr(probe_module, "NAMES", (*NAMES, MISSING_HTTP, MISSING_REDIS))


def test_the_setting_turns_the_fast_path_off_with_one_line() -> None:
    off = probe("off")
    assert (off.http, off.redis) == (False, False)
    assert off.line() == (
        "fast path off: BROKER_FAST_PATH=off; serving with stock uvicorn and redis-py"
    )
    assert probe("auto").line() is None


def test_a_missing_name_turns_off_its_half_and_says_which(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe_module, "NAMES", (*NAMES, MISSING_REDIS))
    found = probe("auto")
    assert (found.http, found.redis) == (True, False)
    line = found.line()
    assert line is not None
    assert line.startswith("fast path off for Redis: missing ")
    assert f"redis.asyncio.connection.ConnectionPool._gone (redis {version('redis')})" in line


@pytest.mark.parametrize("value", ["on", "OFF ", "fast", "false"])
def test_a_bad_fast_path_setting_stops_the_broker_with_one_line(value: str) -> None:
    with pytest.raises(SettingsError, match="BROKER_FAST_PATH must be auto or off"):
        Settings.from_env({"BROKER_FAST_PATH": value})


def test_a_client_on_the_stock_path_has_redis_pys_bounded_pool(redis_url: str) -> None:
    redis_url = single_node(redis_url)
    stock = client(redis_url, wait_s=5.0, max_connections=7, fast=False)
    assert type(stock.connection_pool) is BlockingConnectionPool
    assert stock.connection_pool.max_connections == 7
    assert type(client(redis_url, fast=False).connection_pool) is ConnectionPool
    assert isinstance(client(redis_url, wait_s=5.0).connection_pool, FastBlockingPool)


def test_a_broker_whose_names_are_gone_serves_on_stock_parts_and_says_so_once(
    names_missing: None, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="broker"):
        broker = broker_factory(fast_path="auto")
    lines = [r.getMessage() for r in caplog.records if "fast path" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("fast path off: missing ")
    assert "RequestResponseCycle._gone" in lines[0]
    assert "ConnectionPool._gone" in lines[0]
    assert issubclass(broker.server.config.http_protocol_class, StockHttpProtocol)
    if not broker.runtime.settings.cluster:  # (a cluster client's pools are redis-py's own)
        assert type(broker.runtime.redis.connection_pool) is BlockingConnectionPool
    turn = start_turn(broker.base_url, turn_id="stock-parts", tokens=6)
    read = read_sse(broker.base_url, turn["stream_id"])
    assert [e.event for e in read.events][-1] == "end"
    assert httpx.get(f"{broker.base_url}/healthz", timeout=5).status_code == 200


def test_a_broker_on_the_fast_path_uses_the_fast_parts(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(fast_path="auto")
    assert issubclass(broker.server.config.http_protocol_class, FastHttpProtocol)
    if not broker.runtime.settings.cluster:  # (the fast pools are a single server's)
        assert isinstance(broker.runtime.redis.connection_pool, FastBlockingPool)
