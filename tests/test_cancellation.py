"""Nothing depends on a cancellation reaching its task through the Redis client (issue 14, 1).

redis-py can swallow a ``CancelledError`` that lands while a reply is awaited: the call returns
normally (redis/redis-py #2028, #2665). Readers whose clients left used to stay parked on their
feed until the turn ended, renewal loops renewed for ever, and a shutdown waited for a whole
generation. The ``swallowing`` fixture makes every call of the broker's Redis clients lose the
cancellation that lands on it, as redis-py often does, so each test below holds every time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from broker.fastpath import probe
from broker.periodic import Periodic
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import wait_until


@pytest.fixture(params=["redis-py", "always-swallowed"])
def swallowing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Either redis-py as it is, or a client that never lets a cancellation through a call."""
    if request.param == "always-swallowed":
        for client_class in (Redis, RedisCluster):  # the broker's clients are one or the other
            monkeypatch.setattr(
                client_class, "execute_command", swallowed(client_class.execute_command)
            )
    mode: str = request.param
    return mode


def swallowed(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def execute_command(self: Any, *args: Any, **options: Any) -> Any:
        call = asyncio.ensure_future(original(self, *args, **options))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            return await call  # the reply arrives and the cancellation is lost

    return execute_command


# A read is served in its request's own task (uvicorn's); it needs no other (the connection
# tells it when the client leaves), and one task per process watches every send.
READING = {"RequestResponseCycle.run_asgi", "_wait_for_disconnect", "SendWatch._run"}


def reading_tasks(broker: RunningBroker) -> int:
    """Tasks of the broker's loop that serve a stream read."""

    async def count() -> int:
        names = [getattr(task.get_coro(), "__qualname__", "") for task in asyncio.all_tasks()]
        return sum(1 for name in names if name in READING)

    result: int = broker.call(count())
    return result


def start_long_turn(broker: RunningBroker, tokens_per_s: float = 100) -> tuple[str, str]:
    body = {
        "conversation_id": "churn",
        "messages": [{"role": "user", "content": "a long answer"}],
        "params": {"simulate": {"tokens": 5000, "tokens_per_s": tokens_per_s}},
    }
    created = httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10).json()
    return created["turn_id"], created["stream_id"]


@pytest.mark.usefixtures("swallowing")
def test_readers_whose_clients_left_cost_nothing_afterwards(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    turn_id, stream_id = start_long_turn(broker)
    port = int(broker.base_url.rsplit(":", 1)[1])
    request = f"GET /v1/streams/{stream_id} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    for _ in range(150):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(request)
            assert conn.recv(100)  # the read is live: Redis calls are under way for it
    viewers = 'broker_stream_viewers{dialect="native",mode="sse"}'
    wait_until(lambda: broker.metric(viewers) == 0)  # was ~100 of 150 before the fix
    hub = broker.runtime.hub
    wait_until(lambda: all(not feed.subscriptions for feed in hub._feeds.values()))
    wait_until(lambda: reading_tasks(broker) == 0)
    # The broker still serves readers after the churn.
    with httpx.stream("GET", f"{broker.base_url}/v1/streams/{stream_id}", timeout=10) as response:
        assert response.status_code == 200
        assert next(response.iter_bytes())
    httpx.post(f"{broker.base_url}/v1/turns/{turn_id}/cancel", timeout=10)


@pytest.mark.usefixtures("swallowing")
def test_a_shutdown_ends_a_generation_whose_cancellation_was_swallowed(
    broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = broker_factory()
    # Hold the generation in a Redis call when the shutdown's cancellation lands.
    entered = asyncio.Event()
    client_class = type(broker.runtime.redis)  # a RedisCluster on a cluster
    original = client_class.hincrby

    async def slow_hincrby(self: Any, *args: Any, **kwargs: Any) -> Any:
        if str(args[1]).startswith("calls:"):  # the generation counting its upstream calls
            entered.set()
            try:  # long enough for the test to stop the worker meanwhile
                await asyncio.shield(asyncio.sleep(2))
            except asyncio.CancelledError:
                await asyncio.sleep(1)  # as redis-py does now and then: the cancel is lost
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(client_class, "hincrby", slow_hincrby)
    start_long_turn(broker, tokens_per_s=20)  # 250 s of generation

    async def shut_down() -> float:
        await asyncio.wait_for(entered.wait(), 10)
        worker = broker.runtime.worker
        assert worker is not None
        began = time.monotonic()
        await asyncio.wait_for(worker.stop(drain_timeout_s=0.0), 10)
        return time.monotonic() - began

    took: float = broker.call(shut_down(), timeout=20)
    assert took < 6  # the generation had 250 s to go


def swallowing_step(calls: list[float], inside: asyncio.Event) -> Callable[[], Awaitable[bool]]:
    """A renewal whose Redis call loses the cancellation that lands on it."""

    async def step() -> bool:
        calls.append(time.monotonic())
        inside.set()
        with contextlib.suppress(asyncio.CancelledError):  # the reply came back regardless
            await asyncio.shield(asyncio.sleep(0.05))
        return True

    return step


async def test_a_periodic_loop_stops_though_its_step_swallowed_the_cancellation() -> None:
    calls: list[float] = []
    inside = asyncio.Event()
    loop = Periodic(swallowing_step(calls, inside), 0.01, name="renewal")
    await asyncio.wait_for(inside.wait(), 2)  # the cancellation lands inside a step
    await asyncio.wait_for(loop.stop(), 2)
    assert loop.task.done()
    stopped = len(calls)
    await asyncio.sleep(0.1)
    assert len(calls) == stopped  # no renewal after stop


async def test_a_periodic_loop_ends_when_its_step_says_so() -> None:
    steps = 0

    async def step() -> bool:
        nonlocal steps
        steps += 1
        return steps < 3

    loop = Periodic(step, 0.001, name="renewal")
    await asyncio.wait_for(loop.task, 2)
    assert steps == 3


def dialect_reads(broker: RunningBroker) -> list[str]:
    """Requests that read one live answer through each dialect."""
    base = broker.base_url
    # Three deltas, then silence: a reader waits for the next batch or the heartbeat (15 s).
    slow = {"simulate": {"tokens": 50, "tokens_per_s": 100, "stall_after_deltas": 3}}
    created = httpx.post(
        f"{base}/v1/responses",
        json={
            "model": "simulated",
            "input": "a long answer",
            "background": True,
            "broker": {"params": slow},
        },
        timeout=10,
    ).json()
    chat = {
        "id": "churn-chat",
        "trigger": "submit-message",
        "params": slow,
        "messages": [{"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}],
    }
    with httpx.stream("POST", f"{base}/v1/ui/chat", json=chat, timeout=10) as response:
        assert response.status_code == 200
        next(response.iter_bytes())  # the chat's turn runs: its stream can be resumed
    return [
        f"/v1/responses/{created['id']}?stream=true",
        "/v1/ui/chat/churn-chat/stream",
    ]


@pytest.mark.usefixtures("swallowing")
def test_dialect_readers_whose_clients_left_cost_nothing_afterwards(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory()
    port = int(broker.base_url.rsplit(":", 1)[1])
    for path in dialect_reads(broker):
        request = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        for _ in range(60):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(request)
                assert conn.recv(100)
    # Gone before the next heartbeat (15 s): the reads end as their clients leave.
    wait_until(lambda: reading_tasks(broker) == 0, timeout=3)
    hub = broker.runtime.hub
    wait_until(lambda: all(not feed.subscriptions for feed in hub._feeds.values()), timeout=5)


def test_each_reader_costs_its_request_task_and_one_task_watches_every_send(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory()
    turn_id, stream_id = start_long_turn(broker, tokens_per_s=5)
    port = int(broker.base_url.rsplit(":", 1)[1])
    request = f"GET /v1/streams/{stream_id} HTTP/1.1\r\nHost: x\r\n\r\n".encode()

    async def census() -> collections.Counter[str]:
        names = [getattr(task.get_coro(), "__qualname__", "") for task in asyncio.all_tasks()]
        return collections.Counter(name for name in names if name in READING)

    readers = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
    try:
        for conn in readers:
            conn.sendall(request)
            assert conn.recv(100)
        counts = broker.call(census())
        expected = {"RequestResponseCycle.run_asgi": 20, "SendWatch._run": 1}
        if not probe(broker.settings.fast_path).http:
            # uvicorn's own protocol (BROKER_FAST_PATH=off): its disconnect watch is a task
            # per request, the price of the way back.
            expected["_wait_for_disconnect"] = 20
        assert counts == expected
    finally:
        for conn in readers:
            conn.close()
    wait_until(lambda: reading_tasks(broker) == 0)  # the watch ends with the last reader
    httpx.post(f"{broker.base_url}/v1/turns/{turn_id}/cancel", timeout=10)
