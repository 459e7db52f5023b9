"""The Python client against a real broker: reattach across an API restart, tail, idempotency."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import httpx
import pytest

from broker_client import AttachPolicy, AttachStats, BrokerClient, Conflict, TurnText
from tests.conftest import BrokerFactory, RunningBroker, free_port
from tests.helpers import get_turn, wait_final

FAST = AttachPolicy(max_retries=50, base_delay=0.02, max_delay=0.1, read_timeout=10)


class RestartableApi:
    """An API-only broker on a fixed port that can be stopped and started again."""

    def __init__(self, broker_factory: BrokerFactory, key_prefix: str) -> None:
        self._factory = broker_factory
        self.port = free_port()
        self.key_prefix = key_prefix
        self.url = f"http://127.0.0.1:{self.port}"
        self.current: RunningBroker | None = None

    def start(self) -> None:
        self.current = self._factory(role="api", port=self.port, key_prefix=self.key_prefix)

    def stop(self) -> None:
        assert self.current is not None
        self.current.stop()


@pytest.fixture
def split(broker_factory: BrokerFactory) -> RestartableApi:
    """A worker-only broker and a restartable API broker on the same Redis keys."""
    worker = broker_factory(role="worker")
    api = RestartableApi(broker_factory, worker.settings.key_prefix)
    api.start()
    return api


async def test_attach_reattaches_across_an_api_restart(split: RestartableApi) -> None:
    messages = [{"role": "user", "content": "through the tunnel"}]
    stats = AttachStats()
    text = TurnText()
    ids: list[str] = []
    async with BrokerClient(split.url, policy=FAST) as client:
        turn = await client.start_turn(
            "conv-r",
            messages,
            turn_id="restart",
            params={"simulate": {"tokens": 60, "tokens_per_s": 40}},
        )
        assert turn.created
        async for event in client.attach(turn.stream_id, stats=stats):
            text.feed(event)
            ids.append(event.id)
            if len(ids) == 5:
                await asyncio.to_thread(split.stop)  # the broker goes away mid-answer
                await asyncio.to_thread(split.start)
    assert stats.reconnects >= 1
    assert ids == sorted(set(ids))
    assert text.status == "complete"
    final = await asyncio.to_thread(get_turn, split.url, "restart")
    assert text.text == final["canonical"]["text"]


async def test_start_turn_is_idempotent_and_conflicts_raise(broker: RunningBroker) -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with BrokerClient(broker.base_url, policy=FAST) as client:
        first = await client.start_turn("c", messages, turn_id="idem")
        again = await client.start_turn("c", messages, turn_id="idem")
        assert first.created
        assert not again.created
        assert again.stream_id == first.stream_id
        with pytest.raises(Conflict):
            await client.start_turn("c", [{"role": "user", "content": "other"}], turn_id="idem")


def test_tail_prints_the_whole_answer_across_a_broker_restart(split: RestartableApi) -> None:
    body = {
        "conversation_id": "conv-t",
        "turn_id": "tailed",
        "messages": [{"role": "user", "content": "tail me"}],
        "params": {"simulate": {"tokens": 60, "tokens_per_s": 30}},
    }
    turn = httpx.post(f"{split.url}/v1/turns", json=body, timeout=10).json()
    tail = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_client",
            "tail",
            turn["stream_id"],
            "--url",
            split.url,
            "--max-retries",
            "100",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert tail.stdout is not None
    printed: list[str] = []
    started = threading.Event()

    def pump() -> None:
        assert tail.stdout is not None
        while chunk := tail.stdout.read(1):
            printed.append(chunk)
            started.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    assert started.wait(15), "tail printed nothing"
    split.stop()
    split.start()
    assert tail.wait(timeout=30) == 0, tail.stderr.read() if tail.stderr else ""
    reader.join(5)
    final = wait_final(split.url, "tailed")
    # Regression: a reconnect note once added a newline to the answer on stdout.
    assert "".join(printed) == final["canonical"]["text"] + "\n"
