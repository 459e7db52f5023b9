"""The Durable Streams protocol on the broker: judged by the official conformance suite, and
used by the official TypeScript and Python clients to follow a generation and resume it.

The suite runs under vitest against a live broker (real uvicorn, this session's Redis); its
pass, fail and skip counts are printed, and the gate holds at no fewer passes than ``GATE``,
with none failed. Its subscription tests run too (``DS_SUBSCRIPTIONS=1``): their webhook
receivers listen on loopback, which the broker allows with ``BROKER_WEBHOOK_ALLOW_LOOPBACK``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import BrokerFactory, RunningBroker
from tests.doc_pages import snippets
from tests.helpers import bearer, get_turn, missing_tool, start_turn, wait_final, wait_until

# Brokers of its own processes, on the server the session names: a test of the server too.
pytestmark = pytest.mark.server

FOLDER = Path(__file__).resolve().parent / "node" / "durable-streams"
SUITE = "@durable-streams/server-conformance-tests"
# Passes of suite 0.3.6 here: every test, its 6 subscription tests on (DS_SUBSCRIPTIONS=1).
# The reference server makes 326.
GATE = 338
LONG_POLL = {"ds_long_poll_s": 0.5}  # the suite waits out long polls: keep them short


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        missing_tool("node is not installed (the Durable Streams tests need Node >= 20)")
    if not (FOLDER / "node_modules" / SUITE).is_dir():
        missing_tool("tests/node/durable-streams has no node_modules: run scripts/npm-ci")
    return node


def test_the_official_conformance_suite_passes_at_the_gate(
    broker_factory: BrokerFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = _node()
    # The suite's webhook receivers listen on loopback; 10.0.0.1 must still be refused.
    broker = broker_factory(cors_origins="*", webhook_allow_loopback=1, **LONG_POLL)
    tests = _suite(node, broker, tmp_path / "report.json")
    failed = _failures(tests)
    if failed and all(name.startswith(TIMED) for name in failed):
        # Once more, alone: these wait out TTLs and long polls on the wall clock, and a loaded
        # CI machine has failed one now and then (a sliding TTL read 404 once). A second
        # failure stands.
        pattern = "|".join(re.escape(name) for name in failed)
        again = _suite(node, broker, tmp_path / "again.json", pattern)
        rerun = {t["fullName"]: t for t in again if t["fullName"] in failed}
        ran = [t["status"] in ("passed", "failed") for t in rerun.values()]
        assert len(rerun) == len(failed), "the re-run left out a test that failed"
        assert all(ran), "the re-run skipped a test that failed"
        tests = [rerun.get(t["fullName"], t) for t in tests]
        failed = _failures(tests)
    passed = sum(1 for t in tests if t["status"] == "passed")
    skipped = len(tests) - passed - len(failed)
    with capsys.disabled():  # in the test run's output, passed or not
        print(
            f"\nDurable Streams conformance (0.3.6): {passed} passed, {len(failed)} failed, "
            f"{skipped} skipped of {len(tests)}"
        )
    assert not failed, "failed:\n" + "\n".join(f"{name}: {why}" for name, why in failed.items())
    assert passed >= GATE, f"{passed} passed, below the gate of {GATE}"


# The suite's groups whose tests wait on the wall clock (TTLs, long polls).
TIMED = (
    "TTL Expiration Behavior ",
    "Fork - TTL and Expiry ",
    "Long-Poll Operations ",
    "Long-Poll Edge Cases ",
)


def _suite(
    node: str, broker: RunningBroker, report: Path, names: str | None = None
) -> list[dict[str, Any]]:
    """The conformance suite's tests (those whose full names match ``names``, a regular
    expression, if given), run against ``broker``, as vitest reports them."""
    vitest = FOLDER / "node_modules" / "vitest" / "vitest.mjs"
    command = [node, str(vitest), "run", "--reporter=json", f"--outputFile={report}"]
    if names is not None:
        command += ["-t", names]
    result = subprocess.run(
        command,
        cwd=FOLDER,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={
            **os.environ,
            "DS_URL": f"{broker.base_url}/ds",
            "DS_LONG_POLL_MS": "500",
            "DS_SUBSCRIPTIONS": "1",
        },
    )
    assert report.exists(), f"vitest wrote no report:\n{result.stdout[-3000:]}\n{result.stderr}"
    outcome = json.loads(report.read_text())
    return [t for suite in outcome["testResults"] for t in suite["assertionResults"]]


def _failures(tests: list[dict[str, Any]]) -> dict[str, str]:
    """The failed tests' full names, and why each failed."""
    return {
        t["fullName"]: " ".join(t.get("failureMessages", []))[:2000]
        for t in tests
        if t["status"] == "failed"
    }


def _generation(broker: RunningBroker, turn_id: str, auth: str | None = None) -> dict[str, Any]:
    """A running generation of about two seconds, and its stream's Durable Streams URL."""
    turn = start_turn(
        broker.base_url, turn_id=turn_id, tokens=40, tokens_per_s=20, seed=7, auth=auth
    )
    return {**turn, "url": f"{broker.base_url}/ds/v1/stream/{turn['stream_id']}"}


def _event_ids(broker: RunningBroker, stream_id: str) -> list[str]:
    page = httpx.get(
        f"{broker.base_url}/v1/streams/{stream_id}", params={"format": "json"}, timeout=10
    ).json()
    assert page["up_to_date"]
    return [event["id"] for event in page["events"]]


@pytest.mark.parametrize("live", ["long-poll", "sse"])
def test_the_typescript_client_follows_a_generation_and_resumes_it(
    broker_factory: BrokerFactory, live: str
) -> None:
    node = _node()
    broker = broker_factory(**LONG_POLL)
    turn = _generation(broker, f"ts-{live}")
    result = subprocess.run(
        [node, "follow.mjs"],
        cwd=FOLDER,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "DS_STREAM_URL": turn["url"], "DS_LIVE": live, "DS_CUT": "3"},
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert wait_final(broker.base_url, turn["turn_id"])["status"] == "complete"
    stored = _event_ids(broker, turn["stream_id"])
    assert len(seen["first"]) >= 3
    assert seen["second"], "the resumed read brought nothing: the cut came after the end"
    assert seen["first"] + seen["second"] == stored  # no gap, no duplicate, in order
    assert seen["closed"]


def test_the_python_client_follows_a_generation_and_resumes_it(
    broker_factory: BrokerFactory,
) -> None:
    try:
        import durable_streams
    except ImportError:
        missing_tool("the durable-streams package is not installed (see constraints.txt)")
    broker = broker_factory(**LONG_POLL)
    turn = _generation(broker, "py-follow")
    first: list[str] = []
    with durable_streams.stream(turn["url"], offset="-1", live="long-poll") as response:
        for event in response.iter_events(mode="json"):
            first += [item["id"] for item in event.data]
            saved = event.next_offset
            if len(first) >= 3:
                break
    second: list[str] = []
    kinds: list[str] = []
    # 0.1.0 predates closure: it reads on after the end, so the loop stops at the `end` event.
    with durable_streams.stream(turn["url"], offset=saved, live="long-poll") as response:
        for event in response.iter_events(mode="json"):
            second += [item["id"] for item in event.data]
            kinds += [item["event"] for item in event.data]
            if "end" in kinds:
                break
    assert wait_final(broker.base_url, turn["turn_id"])["status"] == "complete"
    assert first + second == _event_ids(broker, turn["stream_id"])
    assert second


def test_a_generation_is_read_only_and_closes_at_rest(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(**LONG_POLL)
    turn = start_turn(broker.base_url, turn_id="ro", tokens=5, tokens_per_s=0)
    wait_final(broker.base_url, "ro")
    url = f"{broker.base_url}/ds/v1/stream/{turn['stream_id']}"
    for method in ("PUT", "POST", "DELETE"):
        response = httpx.request(
            method, url, content=b"x", headers={"content-type": "text/plain"}, timeout=10
        )
        assert response.status_code == 405, (method, response.text)
    head = httpx.head(url, timeout=10)
    assert head.headers["content-type"] == "application/json"
    assert head.headers["stream-closed"] == "true"
    read = httpx.get(url, timeout=10)
    messages = read.json()
    assert [m["id"] for m in messages] == _event_ids(broker, turn["stream_id"])
    assert messages[-1]["event"] == "end"
    assert read.headers["stream-closed"] == "true"
    assert read.headers["stream-next-offset"] == messages[-1]["id"]
    # At the end: an empty page that says EOF, and a long poll that does not wait.
    tail = httpx.get(url, params={"offset": messages[-1]["id"], "live": "long-poll"}, timeout=10)
    assert tail.status_code == 204
    assert tail.headers["stream-closed"] == "true"


def test_streams_are_their_tenants_own_and_attach_tokens_read_only_their_stream(
    broker_factory: BrokerFactory,
) -> None:
    key_a, key_b = "key-acme-0123456789abcdef", "key-beta-0123456789abcdef"
    broker = broker_factory(api_keys=f"acme={key_a},beta={key_b}", **LONG_POLL)
    base = f"{broker.base_url}/ds/v1/stream"
    text = {"content-type": "text/plain"}
    assert httpx.put(f"{base}/notes", headers=text, timeout=10).status_code == 401
    made = httpx.put(f"{base}/notes", content=b"a's", headers=text | bearer(key_a), timeout=10)
    assert made.status_code == 201
    assert httpx.get(f"{base}/notes", headers=bearer(key_b), timeout=10).status_code == 404
    theirs = httpx.put(f"{base}/notes", content=b"b's", headers=text | bearer(key_b), timeout=10)
    assert theirs.status_code == 201  # the same path, another tenant's stream
    assert httpx.get(f"{base}/notes", headers=bearer(key_a), timeout=10).text == "a's"
    assert httpx.get(f"{base}/notes", headers=bearer(key_b), timeout=10).text == "b's"
    turn = start_turn(broker.base_url, turn_id="tok", tokens=3, tokens_per_s=0, auth=key_a)
    token = httpx.post(
        f"{broker.base_url}/v1/turns/tok/attach-tokens", json={}, headers=bearer(key_a), timeout=10
    ).json()["token"]
    wait_final(broker.base_url, "tok", auth=key_a)
    mine = httpx.get(f"{base}/{turn['stream_id']}", headers=bearer(token), timeout=10)
    assert mine.status_code == 200
    assert mine.json()[-1]["event"] == "end"
    assert (
        httpx.get(f"{base}/{turn['stream_id']}", headers=bearer(key_b), timeout=10).status_code
        == 404
    )
    assert httpx.get(f"{base}/notes", headers=bearer(token), timeout=10).status_code == 403
    append = httpx.post(f"{base}/notes", content=b"!", headers=text | bearer(token), timeout=10)
    assert append.status_code == 403


def test_a_closed_stream_refuses_appends_and_a_waiting_reader_wakes(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(ds_long_poll_s=10)
    url = f"{broker.base_url}/ds/v1/stream/closing"
    text = {"content-type": "text/plain"}
    tail = httpx.put(url, content=b"one", headers=text, timeout=10).headers["stream-next-offset"]
    with httpx.Client(timeout=20) as client:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.get, url, params={"offset": tail, "live": "long-poll"})
            closed = httpx.post(url, headers={"stream-closed": "true"}, timeout=10)
            assert closed.status_code == 204
            woken = waiting.result(timeout=5)  # long before the 10 s wait runs out
    assert woken.status_code == 204
    assert woken.headers["stream-closed"] == "true"
    refused = httpx.post(url, content=b"two", headers=text, timeout=10)
    assert refused.status_code == 409
    assert refused.headers["stream-closed"] == "true"
    assert refused.headers["stream-next-offset"] == tail
    assert httpx.get(url, timeout=10).text == "one"


def test_binary_payloads_go_through_whole_and_wake_a_long_poll(
    broker_factory: BrokerFactory,
) -> None:
    """Every byte value, kept as bytes in Redis: a long poll wakes on it, a catch-up read and
    an SSE read (base64) bring it back whole."""
    broker = broker_factory(ds_long_poll_s=10)
    url = f"{broker.base_url}/ds/v1/stream/binary"
    octets = {"content-type": "application/octet-stream"}
    data = bytes(range(256))
    made = httpx.put(url, content=data, headers=octets, timeout=10)
    assert made.status_code == 201
    with httpx.Client(timeout=20) as client, ThreadPoolExecutor(1) as pool:
        params = {"offset": made.headers["stream-next-offset"], "live": "long-poll"}
        waiting = pool.submit(client.get, url, params=params)
        assert httpx.post(url, content=data[::-1], headers=octets, timeout=10).status_code == 204
        woken = waiting.result(timeout=5)  # long before the 10 s wait runs out
    assert woken.content == data[::-1]
    assert httpx.get(url, timeout=10).content == data + data[::-1]
    assert httpx.post(url, headers={"stream-closed": "true"}, timeout=10).status_code == 204
    sse = httpx.get(url, params={"offset": "-1", "live": "sse"}, timeout=20)
    events = [block for block in sse.text.split("\n\n") if block.startswith("event: data")]
    decoded = [
        base64.b64decode(line[len("data:") :].strip())
        for block in events
        for line in block.splitlines()
        if line.startswith("data:")
    ]
    assert b"".join(decoded) == data + data[::-1]


REFERENCE = FOLDER.parent.parent.parent / "benchmarks" / "durable-reference" / "node_modules"
SMALL = ["--writers", "2", "--appends", "20", "--reads", "1", "--repeat", "1"]


def test_the_durable_streams_benchmark_runs_small() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.durable", *SMALL],
        cwd=FOLDER.parent.parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("appends/s")]
    assert len(rows) == 1
    servers = (2 if REFERENCE.is_dir() else 1) + 2  # and the two floors
    assert rows[0].count("[") == servers  # one median [range] per server
    assert "floor: ASGI, memory" in result.stdout
    assert "floor: ASGI + XADD" in result.stdout
    assert "broker storage: Redis bytes per payload byte" in result.stdout


def test_a_long_poll_whose_client_hangs_up_gives_its_place_back(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(ds_long_poll_s=30)
    url = f"{broker.base_url}/ds/v1/stream/left"
    tail = httpx.put(url, headers={"content-type": "text/plain"}, timeout=10)
    params = {"offset": tail.headers["stream-next-offset"], "live": "long-poll"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(url, params=params, timeout=httpx.Timeout(10, read=0.5))
    # Long before its 30 s run out, the wait left the stream's feed.
    wait_until(lambda: broker.runtime.hub.readers == 0, timeout=5)


def test_an_expired_generation_is_gone_not_unknown(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(stream_ttl=0.5, **LONG_POLL)
    # Read while the turn runs (its keys expire only once it ends), then end it: whatever the
    # machine's pace, the first read comes before the expiry (regression: with a finished turn
    # the read raced the 0.5 s expiry and lost on a loaded machine).
    turn = start_turn(broker.base_url, turn_id="ds-old", tokens=1000, tokens_per_s=10)
    url = f"{broker.base_url}/ds/v1/stream/{turn['stream_id']}"
    wait_until(lambda: get_turn(broker.base_url, "ds-old")["status"] == "streaming")
    assert httpx.get(url, timeout=5).status_code == 200
    httpx.post(f"{broker.base_url}/v1/turns/ds-old/cancel", timeout=5).raise_for_status()
    wait_final(broker.base_url, "ds-old")
    gone = wait_until(lambda: (r := httpx.get(url, timeout=5)).status_code == 410 and r, 5)
    assert gone.json()["error"]["code"] == "expired"
    assert httpx.head(url, timeout=5).status_code == 410
    unknown = f"{broker.base_url}/ds/v1/stream/st_{'0' * 32}"
    assert httpx.get(unknown, timeout=5).status_code == 404


def test_the_subscriptions_example_runs_verbatim(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    """docs/durable-streams.md's pull-wake round in bash as a reader would paste it: the wake
    reaches the wake stream, the claim takes it, the ack ends it with nothing left."""
    from tests.test_readme import Terminal, ok

    [example] = snippets("durable-streams.md", "Subscriptions", "sh")
    shell = Terminal(tmp_path)
    shell.port = httpx.URL(broker_factory(**LONG_POLL).base_url).port
    printed = ok(shell.run(example))
    assert '"subscription_id":"workers"' in printed
    assert '"streams":["jobs/42"]' in printed
    assert printed.rstrip().endswith('{"ok":true,"next_wake":false}')
