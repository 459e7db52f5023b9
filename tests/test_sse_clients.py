"""Every common SSE client, with its textbook loop, reads a live broker stream across cuts.

Each library reads a turn under way from ``now`` through a TCP proxy (``tests/tcp_proxy.py``, or
its Node twin in ``tests/node/sse-clients``) that the test cuts twice: with an RST right after
the read's resume point arrives (before its first event, so the resume point must hold), then
with a FIN a few events later (a server closing mid-stream). Each reattaches the way its
documentation says, and what it got must be exactly the stream's events after the resume
point: no gap, no repeat, and every event's data parsed with the textbook JSON parse (the
``retry:``-only and id-only frames of old, and heartbeats after a blank line, were empty
events to httpx-sse and fetch-event-source, whose parse then raised).

The brokers run with a short ``retry:`` and heartbeat, so reconnects take milliseconds and
heartbeats fall between events.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from httpx_sse import connect_sse

from broker_client import AttachPolicy, AttachStats, BrokerClient
from tests.chromium import CHROMIUM, launched
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import missing_tool, read_sse, start_turn, wait_until
from tests.tcp_proxy import CutProxy

# The clients' side: CI's passes on other servers leave it out (see .ci/run).
pytestmark = pytest.mark.client_side

FAST = {"sse_retry_ms": 50, "sse_heartbeat_s": 0.02}
STREAM_TYPES = {"attempt", "delta", "tool_call", "tool_result", "usage", "error", "end"}
NODE_TESTS = Path(__file__).resolve().parent / "node" / "sse-clients"
# What a library got, in order: (event type, id, data parsed as JSON).
Seen = tuple[str, str, Any]


def live_turn(broker: RunningBroker, turn_id: str) -> tuple[str, str]:
    """A turn under way with a few events stored (a read from ``now`` has a past to skip): its
    stream id and the stream's tail before any read."""
    turn = start_turn(
        broker.base_url, "sse-clients", turn_id=turn_id, seed=turn_id, tokens=40, tokens_per_s=30
    )
    url = f"{broker.base_url}/v1/streams/{turn['stream_id']}"

    def stored() -> list[dict[str, Any]]:
        page = httpx.get(url, params={"format": "json", "offset": "-1"}, timeout=5).json()
        events: list[dict[str, Any]] = page["events"]
        return events if len(events) >= 3 else []

    past = wait_until(stored)
    return turn["stream_id"], past[-1]["id"]


def check_read(
    broker: RunningBroker,
    stream_id: str,
    tail: str,
    seen: list[Seen],
    proxy: CutProxy,
    *,
    resume_point: bool = True,
) -> None:
    """What every library must show: see the module's docstring."""
    resumes = [item for item in seen if item[0] == "resume_point"]
    events = [item for item in seen if item[0] != "resume_point"]
    assert {kind for kind, _, _ in events} <= STREAM_TYPES
    whole = [(e.event, e.id, e.data) for e in read_sse(broker.base_url, stream_id).events]
    start = tail
    if resume_point:
        # One resume point: the reattaches named their last event, never `now` again.
        assert len(resumes) == 1, resumes
        _, start, data = resumes[0]
        assert data == {"offset": start}
        assert start >= tail
        assert events == [e for e in whole if e[1] > start]
    else:  # a client that keeps it to itself: a run of the stream's last events
        assert events == whole[len(whole) - len(events) :]
    assert events[0][1] > start
    assert events[-1][0] == "end"
    assert events[-1][2]["status"] == "complete"
    reads = [line for line in proxy.requests() if line.startswith(f"GET /v1/streams/{stream_id}")]
    assert len(reads) >= 3, "two cuts, two reattaches"
    assert any(b"\n: ping\n" in body for body in proxy.bodies()), "heartbeats crossed the wire"


class Cutter:
    """Cuts ``proxy`` as a library's events arrive: an RST once the resume point is in (before
    the first event, when it comes first), then a FIN after five events."""

    def __init__(self, proxy: CutProxy) -> None:
        self.proxy, self.cuts, self.events = proxy, 0, 0

    def saw(self, kind: str) -> None:
        self.events += kind != "resume_point"
        if self.cuts == 0 and kind == "resume_point":
            self.cut(reset=True)
        elif self.cuts == 1 and self.events >= 5:
            self.cut(reset=False)

    def cut(self, *, reset: bool) -> None:
        self.cuts += 1
        self.proxy.cut(reset=reset)


# --- the wire ------------------------------------------------------------------------------


def _blocks(body: str) -> list[list[str]]:
    """The blocks a spec parser dispatches: the lines before each blank line."""
    blocks: list[list[str]] = []
    lines: list[str] = []
    for line in body.split("\n")[:-1]:
        if line:
            lines.append(line)
        else:
            blocks.append(lines)
            lines = []
    return blocks


def _body(url: str, headers: dict[str, str] | None = None) -> str:
    with httpx.stream("GET", url, headers=headers or {}, timeout=15) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        return response.read().decode()


def test_every_block_on_the_wire_is_an_event_with_data(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(**FAST)
    stream_id, _ = live_turn(broker, "wire")
    url = f"{broker.base_url}/v1/streams/{stream_id}"
    from_now = _body(url + "?offset=now")
    from_start = _body(url)
    first = _blocks(from_start)[0]
    resumed = _body(url, {"Last-Event-ID": first[1].removeprefix("id: ")})
    for body in (from_now, from_start, resumed):
        blocks = _blocks(body)
        assert body.endswith("\n\n")
        assert all(any(line.startswith("data: ") for line in block) for block in blocks), body
        assert all(json.loads(line[6:]) for b in blocks for line in b if line.startswith("data:"))
    assert ": ping" in from_now, "heartbeats are comment lines inside the next block"
    # From `now`: the resume point is an event of its own, which carries the `retry:`.
    opening = _blocks(from_now)[0]
    offset = opening[1].removeprefix("id: ")
    assert opening == [
        "retry: 50",
        f"id: {offset}",
        "event: resume_point",
        f'data: {{"offset":"{offset}"}}',
    ]
    assert "resume_point" not in from_now.split("\n\n", 1)[1]
    # From the start, or after a named event: `retry:` is the first line of the first event's
    # block, and there is no resume_point (the client already holds its resume point).
    assert first[0] == "retry: 50"
    assert first[2] == "event: attempt"
    assert _blocks(resumed)[0][0] == "retry: 50"
    assert "resume_point" not in from_start + resumed


# --- Python libraries ------------------------------------------------------------------------


def test_httpx_sse_textbook_loop_reattaches_without_gap_repeat_or_parse_error(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(**FAST)
    stream_id, tail = live_turn(broker, "httpx-sse")
    seen: list[Seen] = []
    with CutProxy(broker.base_url) as proxy, httpx.Client(timeout=10) as client:
        cutter = Cutter(proxy)
        url = f"{proxy.url}/v1/streams/{stream_id}?offset=now"
        # httpx-sse's documented reconnect loop: resend the last sse.id as Last-Event-ID after
        # a read error, waiting the server's retry: first.
        last_event_id, delay, done, connections = "", 0.0, False, 0
        while not done:
            connections += 1
            assert connections <= 10, "too many reconnections"
            time.sleep(delay)  # the server's reconnection time, as the loop documents it
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            try:
                with connect_sse(client, "GET", url, headers=headers) as source:
                    for sse in source.iter_sse():
                        last_event_id = sse.id
                        if sse.retry is not None:
                            delay = sse.retry / 1000
                        seen.append((sse.event, sse.id, sse.json()))  # raises on empty data
                        cutter.saw(sse.event)
                        if sse.event == "end":
                            done = True
                            break
            except (httpx.ReadError, httpx.RemoteProtocolError):
                continue  # an RST, or a FIN in the middle of the body: reconnect
    assert cutter.cuts == 2
    check_read(broker, stream_id, tail, seen, proxy)


async def test_the_python_client_reattaches_without_gap_repeat_or_parse_error(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(**FAST)
    stream_id, tail = live_turn(broker, "python-client")
    seen: list[Seen] = []
    stats = AttachStats()
    policy = AttachPolicy(base_delay=0.05, max_delay=0.2)
    with CutProxy(broker.base_url) as proxy:
        cutter = Cutter(proxy)

        async def cut_at_the_resume_point() -> None:
            # The client keeps its resume point to itself (in its stats): cut once it has one.
            deadline = time.monotonic() + 10
            while stats.last_event_id is None:
                assert time.monotonic() < deadline, "no resume point"
                await asyncio.sleep(0.005)
            await asyncio.to_thread(cutter.cut, reset=True)

        first_cut = asyncio.create_task(cut_at_the_resume_point())
        async with BrokerClient(proxy.url, policy=policy) as client:
            async for event in client.attach(stream_id, offset="now", stats=stats):
                seen.append((event.type, event.id, event.data))
                cutter.saw(event.type)
        await first_cut
    assert cutter.cuts == 2
    assert stats.duplicates == 0
    assert stats.reconnects >= 2
    check_read(broker, stream_id, tail, seen, proxy, resume_point=False)


def test_the_openai_sdk_reads_a_chat_completion_with_heartbeats_between_its_chunks(
    broker_factory: BrokerFactory,
) -> None:
    """Regression: the chat dialect's chunks carry ids, and the openai Python SDK's parser, like
    httpx-sse's, turned a heartbeat ended by a blank line into an empty event after one, whose
    JSON parse raised: any quiet moment of the stream (a slow tool call, a queued turn) broke it.
    """
    broker = broker_factory(**FAST)
    sdk = openai.OpenAI(base_url=f"{broker.base_url}/v1", api_key="unused", max_retries=0)
    simulate = {"seed": 1, "tokens": 20, "tokens_per_s": 30}  # a heartbeat between each two
    stream = sdk.chat.completions.create(
        model="simulated",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"broker": {"params": {"simulate": simulate}}},
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert sum(bool(c.choices[0].delta.content) for c in chunks) == 20


# --- the browser's EventSource -----------------------------------------------------------

# The textbook loop: a listener per event type that JSON.parses the data, and onmessage for
# unnamed events (the broker sends none: one would be a loose frame). The browser reconnects by
# itself, sending Last-Event-ID; the page closes the source after the `end` event.
READER = """
([url, types]) => {
  window.seen = [];
  window.errors = [];
  window.done = false;
  const source = new EventSource(url);
  const onEvent = (event) => {
    // EventSource's own `error` event (a lost connection) shares the broker's `error` event's
    // name: only a message has data.
    if (!(event instanceof MessageEvent)) return;
    let data = null;
    try {
      data = JSON.parse(event.data);
    } catch (error) {
      window.errors.push(`${event.type} ${JSON.stringify(event.data)}: ${error.message}`);
    }
    window.seen.push([event.type, event.lastEventId, data]);
    if (event.type === "end") {
      source.close();
      window.done = true;
    }
  };
  for (const type of types) source.addEventListener(type, onEvent);
  source.onmessage = onEvent;
}
"""


def test_eventsource_in_chromium_reattaches_without_gap_repeat_or_parse_error(
    broker_factory: BrokerFactory,
) -> None:
    if not CHROMIUM.exists():
        missing_tool(f"{CHROMIUM} is not installed (apt-get install chromium)")
    broker = broker_factory(**FAST)
    types = [*sorted(STREAM_TYPES), "resume_point"]
    with CutProxy(broker.base_url) as proxy, launched() as browser:
        page = browser.new_page()
        page.set_default_timeout(15_000)
        page.goto(f"{proxy.url}/healthz")  # a page of the broker's origin: no CORS in the way
        stream_id, tail = live_turn(broker, "eventsource")  # the browser is up: the turn is short
        page.evaluate(READER, [f"/v1/streams/{stream_id}?offset=now", types])
        page.wait_for_function("window.seen.some(([type]) => type === 'resume_point')")
        assert proxy.cut(reset=True) == 1
        # The FIN cuts the reattach once an event came over it. (Waiting on what the page saw
        # raced: events the first connection carried before its RST could count, and the cut
        # then fell in the browser's retry wait, with no connection to end.)
        wait_until(lambda: sum(b"\nevent: " in body for body in proxy.bodies()) >= 2)
        assert proxy.cut(reset=False) == 1
        page.wait_for_function("window.done")
        errors = page.evaluate("window.errors")
        seen = [(kind, id_, data) for kind, id_, data in page.evaluate("window.seen")]
    assert errors == []
    check_read(broker, stream_id, tail, seen, proxy)


# --- Node libraries --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["eventsource", "fetch-event-source", "broker-client"],
    ids=["npm-eventsource", "fetch-event-source", "js-client"],
)
def test_node_sse_client_reattaches_without_gap_repeat_or_parse_error(
    broker_factory: BrokerFactory, name: str
) -> None:
    node = shutil.which("node")
    if node is None:
        missing_tool("node is not installed (the Node SSE client tests need Node >= 20)")
    for package in ("eventsource", "@microsoft/fetch-event-source"):
        if not (NODE_TESTS / "node_modules" / package).is_dir():
            missing_tool("tests/node/sse-clients has no node_modules: run scripts/npm-ci")
    broker = broker_factory(**FAST)
    result = subprocess.run(
        [node, "--test", f"test/{name}.test.js"],
        cwd=NODE_TESTS,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "BROKER_URL": broker.base_url},
    )
    assert result.returncode == 0, f"node --test failed:\n{result.stdout}\n{result.stderr}"
    assert "# pass 1" in result.stdout, result.stdout
