"""The docs' "Try it" sections and the Python client example, run verbatim and in order.

The quickstart's two "Try it" sections, the tool-call page's and the native page's Python
client example (the README's own "Try it" is the quickstart's opening blocks, word for word).
A live ``broker serve`` process (on the session's Redis, under a key prefix of its own) takes the
place of the reader's first terminal; every ``sh`` block of a "Try it" section runs in bash as
the second terminal would run it, with ``localhost:8000`` rewritten to the broker's port and
the shell variables a block sets (``STREAM``, ``LAST``, ...) carried to the next one. The block
that starts servers ("in the first terminal") is parsed, and each command it names is started.
Then what each block printed is checked against the broker's own account of the turns.

Regression (issue 14): the examples had drifted (a comment where a wait belonged, no runnable
tool-call example, a Python example reusing ``turn-2``, which the stop example had taken).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import BrokerFactory, BrokerProcess, _prefixes
from tests.doc_pages import ROOT, headed, pages, read, snippets
from tests.helpers import missing_tool, read_sse, start_turn
from tests.tcp_proxy import CutProxy

# Brokers of its own processes, on the server the session names: a test of the server too.
pytestmark = pytest.mark.server

BLOCK_TIMEOUT_S = 60.0
# (page, heading) of every "Try it" of the site, in the order this test runs them.
SECTIONS = (
    ("quickstart.md", "Try it: start, cut, reattach, second viewer"),
    ("quickstart.md", "Try it: stop, interruption, continue, regenerate"),
    ("tools.md", "Try it: a payment that survives a regenerate"),
    ("tools.md", "Try it: a payment that waits for a yes"),
)
README_TRY_IT = "Try it: a reconnect and a second viewer"
SpawnBroker = Callable[[dict[str, str]], BrokerProcess]


def try_it_titles(page: str) -> list[str]:
    return [heading for heading, _ in headed(read(page)) if heading.startswith("Try it")]


def events_of(sse: str) -> list[tuple[str, dict[str, Any]]]:
    """``(event, data)`` of every event in SSE text (or in grep's excerpt of it)."""
    found: list[tuple[str, dict[str, Any]]] = []
    name: str | None = None
    for line in sse.splitlines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: ") and name is not None:
            found.append((name, json.loads(line.removeprefix("data: "))))
            name = None
    return found


def outputs(text: str) -> list[Any]:
    """What a block printed, in order: each JSON body a curl printed (curl adds no newline, so
    the next output may follow on the same line) and each run of other lines, as one string."""
    decoder = json.JSONDecoder()
    found: list[Any] = []
    lines: list[str] = []
    index = 0
    while index < len(text):
        if text[index] in "{[":
            if lines:
                found.append("\n".join(lines))
                lines = []
            value, index = decoder.raw_decode(text, index)
            found.append(value)
            continue
        end = text.find("\n", index)
        end = len(text) if end < 0 else end
        if end > index:
            lines.append(text[index:end])
        index = end + 1
    if lines:
        found.append("\n".join(lines))
    return found


def statuses(sse: str) -> list[tuple[str, str]]:
    """``(event, source or strategy or status)`` of each event, the fields the docs name."""
    return [
        (name, str(data.get("source", data.get("strategy", data.get("status")))))
        for name, data in events_of(sse)
    ]


class Terminal:
    """The reader's second terminal: runs blocks in bash, keeping their variables in between."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.state = cwd / "state.sh"
        self.port: int | None = None
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        drop = {"broker_url", "broker_api_key", "http_proxy", "https_proxy", "all_proxy"}
        self.env = {k: v for k, v in os.environ.items() if k.lower() not in drop}
        self.env |= {"PATH": path, "NO_PROXY": "*", "PYTHONUNBUFFERED": "1"}

    def run(self, block: str) -> subprocess.CompletedProcess[str]:
        assert self.port is not None
        addresses = ("localhost:8000", "127.0.0.1:8000", "broker_client")
        assert any(address in block for address in addresses), "it talks to no broker"
        script = block.replace("localhost:8000", f"localhost:{self.port}")
        script = script.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")
        # `python -m broker_client` defaults to $BROKER_URL, else http://127.0.0.1:8000.
        self.env["BROKER_URL"] = f"http://127.0.0.1:{self.port}"
        names = sorted(set(re.findall(r"^([A-Z][A-Z0-9_]*)=", block, re.M)))
        keep = f"declare -p {' '.join(names)} >>{shlex.quote(str(self.state))}" if names else ""
        full = f"[ -f state.sh ] && source state.sh\n{script}\nstatus=$?\n{keep}\nexit $status\n"
        return subprocess.run(
            ["bash", "-c", full],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )

    def variable(self, name: str) -> str:
        done = subprocess.run(
            ["bash", "-c", f'source state.sh && printf %s "${name}"'],
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return done.stdout


class FirstTerminal:
    """Starts what a docs block runs in the first terminal: brokers and example servers."""

    def __init__(self, spawn: SpawnBroker, redis_url: str) -> None:
        self.spawn = spawn
        self.base = {
            "BROKER_REDIS_URL": redis_url,
            "BROKER_KEY_PREFIX": f"readme{os.getpid()}-{next(_prefixes)}",
        }
        self.broker: BrokerProcess | None = None
        self.servers: list[subprocess.Popen[str]] = []

    @property
    def port(self) -> int:
        assert self.broker is not None
        port = httpx.URL(self.broker.base_url).port
        assert port is not None
        return port

    def serve(self, env: dict[str, str]) -> None:
        """``broker serve`` as a process; a running one is stopped first, as with Ctrl-C."""
        if self.broker is not None:
            assert self.broker.stop(signal.SIGINT) == 0
        self.broker = self.spawn({**self.base, **env})

    def run(self, block: str) -> None:
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            env: dict[str, str] = {}
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            background = bool(words) and words[-1] == "&"
            command = words[:-1] if background else words
            if command == ["broker", "serve"]:
                self.serve(env)
            elif command[:1] == ["python"] and background and not env:
                self.start_server([sys.executable, *command[1:]])
            else:
                pytest.fail(f"the test cannot run this first-terminal line: {line!r}")

    def start_server(self, argv: list[str]) -> None:
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.servers.append(process)
        assert process.stdout is not None
        started = threading.Event()
        lines: list[str] = []

        def pump() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line)
                if " serving on " in line:
                    started.set()

        threading.Thread(target=pump, daemon=True).start()
        if not started.wait(15):
            pytest.fail(f"{' '.join(argv)} did not start (port taken?):\n{''.join(lines)}")

    def stop(self) -> None:
        for process in self.servers:
            process.terminate()  # only the servers this test started, by their handle
            process.wait(timeout=10)


@pytest.fixture
def first_terminal(broker_processes: SpawnBroker, redis_url: str) -> Iterator[FirstTerminal]:
    terminal = FirstTerminal(broker_processes, redis_url)
    yield terminal
    terminal.stop()


def api(terminal: FirstTerminal, path: str) -> Any:
    assert terminal.broker is not None
    response = httpx.get(f"{terminal.broker.base_url}{path}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_docs_have_the_try_it_sections_this_test_runs() -> None:
    found = [(page, title) for page in pages() for title in try_it_titles(page)]
    assert sorted(found) == sorted(SECTIONS)
    assert try_it_titles("README.md") == [README_TRY_IT]


def test_the_readme_try_it_is_the_quickstarts_opening_word_for_word() -> None:
    """The README's reconnect and second viewer are the quickstart's first blocks, so the run
    below runs them; a block changed in one place and not the other fails here."""
    readme = snippets("README.md", README_TRY_IT, "sh")
    quickstart = snippets(*SECTIONS[0], "sh")
    assert len(readme) >= 4
    assert readme == quickstart[: len(readme)]
    shown = "".join(readme)
    assert "Last-Event-ID" in shown  # the reconnect
    assert "broker_client tail" in shown  # the second viewer


def test_the_readme_examples_run_verbatim_in_order(
    first_terminal: FirstTerminal, tmp_path: Path
) -> None:
    start, stop, pay, wait = (snippets(page, title, "sh") for page, title in SECTIONS)
    assert (len(start), len(stop), len(pay), len(wait)) == (5, 3, 2, 1)
    shell = Terminal(tmp_path)

    # --- start, cut, reattach, second viewer -------------------------------------------------
    first_terminal.serve({})
    shell.port = first_terminal.port
    created = json.loads(ok(shell.run(start[0])))
    assert created["turn_id"] == "turn-1"
    assert created["status"] in ("queued", "streaming")

    cut = shell.run(start[1])  # curl --max-time 3 gives up: exit 28, as the reader intends
    assert cut.returncode == 0, cut.stderr  # tee's status: the pipeline's last command
    first = events_of(cut.stdout)
    assert cut.stdout.startswith("retry: ")
    assert [name for name, _ in first][:2] == ["attempt", "delta"]
    assert "end" not in [name for name, _ in first], "the cut came after the end"
    assert shell.variable("STREAM") == created["stream_id"]
    assert (tmp_path / "first.txt").read_text() == cut.stdout

    rest = events_of(ok(shell.run(start[2])))
    name, data = rest[-1]
    assert (name, data["status"]) == ("end", "complete")
    assert "attempt" not in [name for name, _ in rest]  # exactly the rest, nothing again
    turn_1 = api(first_terminal, "/v1/turns/turn-1")
    assert turn_1["status"] == "complete"
    delivered = "".join(data["text"] for name, data in first + rest if name == "delta")
    assert delivered == turn_1["canonical"]["text"]  # no gap, no duplicate across the cut

    tails = shell.run(start[3])
    assert ok(tails) == turn_1["canonical"]["text"] + "\n"  # the second `tail` adds nothing
    assert tails.stderr.count("status: complete") == 2

    page = json.loads(ok(shell.run(start[4])))
    assert [e["event"] for e in page["events"]][-1] == "end"
    assert (page["up_to_date"], page["closed"]) == (True, True)

    # --- a phone's background loop (the native page's long poll), on the same stream ----------
    [poll] = snippets("native.md", "Mobile clients", "sh")
    counted = ok(shell.run(poll)).splitlines()
    assert all(re.fullmatch(r"\d+ events", line) for line in counted), counted
    assert sum(int(line.split()[0]) for line in counted) == len(page["events"])  # then it stops

    # --- stop, interruption, continue, regenerate ---------------------------------------------
    started, cancelled = outputs(ok(shell.run(stop[0])))
    assert started["turn_id"] == "turn-2"
    assert cancelled["status"] == "cancelled"
    turn_2 = api(first_terminal, "/v1/turns/turn-2")
    assert turn_2["status"] == "cancelled"
    assert turn_2["canonical"]["text"]  # the text so far stays

    broke, retried = outputs(ok(shell.run(stop[1])))
    assert statuses(broke) == [("end", "interrupted")]
    assert (retried["turn_id"], retried["status"], retried["attempt"]) == ("turn-3", "queued", 2)

    [both] = outputs(ok(shell.run(stop[2])))  # returns once the continue has ended
    assert statuses(both) == [
        ("attempt", "initial"),
        ("end", "interrupted"),
        ("attempt", "continue"),
        ("end", "complete"),
    ]
    turn_3 = api(first_terminal, "/v1/turns/turn-3")
    assert turn_3["status"] == "complete"
    assert [a["status"] for a in turn_3["attempts"]] == ["partial", "complete"]
    history = api(first_terminal, "/v1/conversations/demo/messages")
    assert [t["turn_id"] for t in history["turns"]] == ["turn-1", "turn-2", "turn-3"]

    # --- a payment that survives a regenerate --------------------------------------------------
    servers, sequence = pay
    first_terminal.run(servers)
    shell.port = first_terminal.port
    first_read, regenerated, second_read, ledger, payments = outputs(ok(shell.run(sequence)))
    assert statuses(first_read) == [("tool_result", "ran"), ("end", "interrupted")]
    paid = events_of(first_read)[0][1]["result"]
    assert (regenerated["turn_id"], regenerated["attempt"]) == ("pay-1", 2)
    assert statuses(second_read) == [
        ("tool_result", "ran"),
        ("end", "interrupted"),
        ("tool_result", "replayed"),
        ("end", "complete"),
    ]
    assert events_of(second_read)[2][1]["result"] == paid  # the stored result, not a new payment
    rows = ledger["tool_calls"]
    assert [(row["tool"], row["state"]) for row in rows] == [("send_payment", "completed")]
    assert payments["count"] == 1
    assert [(p["to"], p["amount"], p["payment_id"]) for p in payments["payments"]] == [
        ("bob", 10.0, paid["payment_id"])
    ]

    # --- a payment that waits for a person's yes ---------------------------------------------
    approved, too_late, waited, payments = outputs(ok(shell.run(wait[0])))
    assert (approved["decision"], approved["by"]) == ("approve", "person")
    assert too_late["error"]["code"] == "approval_decided"
    assert too_late["decision"] == "approve"
    assert statuses(waited) == [
        ("approval_request", "None"),
        ("approval_decision", "None"),
        ("tool_result", "ran"),
        ("end", "complete"),
    ]
    assert payments["count"] == 2
    assert (payments["payments"][1]["to"], payments["payments"][1]["amount"]) == ("bob", 500.0)
    assert api(first_terminal, "/v1/turns/pay-2")["status"] == "complete"

    # --- the Python client example, against the same broker ---------------------------------
    [example] = snippets("native.md", "Python client", "python")
    assert "http://127.0.0.1:8000" in example
    code = example.replace("http://127.0.0.1:8000", f"http://127.0.0.1:{first_terminal.port}")
    ran = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        check=False,
        env=shell.env,
    )
    assert ran.returncode == 0, ran.stderr  # a reused turn id answers 409 and raises
    assert ran.stdout.rstrip().endswith("complete")
    turns = api(first_terminal, "/v1/conversations/demo/messages")["turns"]
    assert [t["turn_id"] for t in turns] == ["turn-1", "turn-2", "turn-3", "turn-py"]


def test_the_durable_streams_shell_examples_run_verbatim(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    """A stream of one's own (create, append, read, follow, close) and a generation read as a
    Durable Stream, each block in bash as a reader would paste it."""
    own, generation = snippets("durable-streams.md", "Durable Streams", "sh")
    shell = Terminal(tmp_path)
    shell.port = httpx.URL(broker_factory().base_url).port
    printed = ok(shell.run(own))  # returns once the close has ended the live reader too
    statuses = re.findall(r"^HTTP/1\.1 (\d+)", printed, re.M)
    assert statuses[:2] == ["201", "204"]  # created, then appended
    assert statuses[-1] == "204"  # the close
    assert "hello, world" in printed  # the catch-up read from -1
    # The follower started with `&` ends at the close. (Whether it prints the `!` depends on
    # whether it connected before that append: pasted at once, the blocks race; typed, it does.)
    assert '"streamClosed":true' in printed
    read = ok(shell.run(generation))  # returns at the close, when the turn is at rest
    events = [
        json.loads(line.removeprefix("data:").strip())
        for line in read.splitlines()
        if line.startswith("data:") and line.strip() != "data:"
    ]
    assert events
    messages = [event for batch in events if isinstance(batch, list) for event in batch]
    assert messages, read
    assert messages[-1]["event"] == "end"
    assert messages[-1]["data"]["status"] == "complete"


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses a TCP port listens on, from Linux's socket table."""
    found: set[str] = set()
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        address, _, hex_port = local.partition(":")
        if int(hex_port, 16) == port and state == "0A":  # 0A: LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


def test_payments_example_counts_each_payment_and_binds_loopback(tmp_path: Path) -> None:
    """The example endpoint on its own: it counts every POST, whatever its Idempotency-Key."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "examples/payments/server.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.fullmatch(r"payments serving on (http://127\.0\.0\.1:\d+)\n", line)
        assert match, line
        url = match.group(1)
        body = {"name": "send_payment", "arguments": {"to": "bob", "amount": 10}}
        for _ in range(2):
            answer = httpx.post(f"{url}/pay", json=body, headers={"Idempotency-Key": "k"})
            assert answer.status_code == 200
        assert httpx.post(f"{url}/pay", json={"arguments": {}}).status_code == 400
        counted = httpx.get(f"{url}/payments").json()
        assert counted["count"] == 2
        assert [p["payment_id"] for p in counted["payments"]] == [1, 2]
        assert [p["idempotency_key"] for p in counted["payments"]] == ["k", "k"]
        port = int(url.rpartition(":")[2])
        if Path("/proc/net/tcp").exists():  # Linux: check the bound address itself
            assert listening_addresses(port) == {"127.0.0.1"}
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_durable_streams_python_example_ends_at_the_close(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    """The Durable Streams page's Python example, run verbatim on a live generation.

    Regression (issue 34, finding 12): the example never ended: durable-streams 0.1.0 predates
    closure and polled the closed stream on (1,904 requests in 3 s). Every request it makes
    goes through a proxy that counts them: one per batch of events, a few more at most.
    """
    if importlib.util.find_spec("durable_streams") is None:
        missing_tool("the durable-streams package is not installed (see constraints.txt)")
    [example] = snippets("durable-streams.md", "Durable Streams", "python")
    broker = broker_factory()
    turn = start_turn(broker.base_url, turn_id="ds-readme", tokens=20, tokens_per_s=10)
    with CutProxy(broker.base_url) as proxy:
        prelude = f"DS = {proxy.url + '/ds/v1/stream'!r}\nstream_id = {turn['stream_id']!r}\n"
        script = f"{prelude}saved = None\n{example}\nprint(saved)\n"
        try:
            ran = subprocess.run(
                [sys.executable, "-c", script],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=20,  # the answer takes 2 s
                check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"the example did not end: {len(proxy.requests())} requests in 20 s")
        requests = proxy.requests()
    assert ran.returncode == 0, ran.stderr
    events = read_sse(broker.base_url, turn["stream_id"]).events
    assert events[-1].event == "end"
    assert ran.stdout.strip() == events[-1].id  # it read to the end, and stopped there
    assert all(line.startswith(f"GET /ds/v1/stream/{turn['stream_id']}") for line in requests)
    assert 1 <= len(requests) <= len(events) + 2, requests
