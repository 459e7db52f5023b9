"""``broker loadgen``: drive a running broker with a mix of simulated turns and report the outcome.

A client tool, so it lives with the client and reads streams with the client's SSE decoder; the
broker's command line runs it.

Every turn uses the simulated provider's knobs, so a run needs no model and no keys. Kinds:
``normal`` (plain text), ``retried`` (the first upstream call fails before any delta and is
retried silently), ``interrupted`` (the call breaks halfway), ``cancelled`` (the stop button is
pressed once a quarter of ``--tokens`` deltas were read, in a turn four times as long, so that
the stop lands while it streams even when its reader is behind) and ``tool`` (one scripted tool
call halfway; with no tool of that name registered the model gets an ``unknown_tool`` result and
finishes). Each turn is read to its ``end`` event over SSE, reattaching with ``Last-Event-ID`` if
the connection is cut.

The run is bounded: ``--turns`` (or ``--rate`` x ``--duration``) turns are started at ``--rate``
per second, at most ``--concurrency`` at once (a full pool delays the next start), and each turn
is given up after ``--timeout`` seconds. Requests go only to ``--url``: redirects are not followed
and proxy variables are ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import difflib
import json
import math
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, TextIO

import httpx

from .sse import SSEDecoder

KINDS = ("normal", "retried", "interrupted", "cancelled", "tool")
EXPECTED = {
    "normal": "complete",
    "retried": "complete",
    "interrupted": "interrupted",
    "cancelled": "cancelled",
    "tool": "complete",
}
STATUSES = ("complete", "interrupted", "cancelled", "failed")
NO_END = "no_end"  # the turn's read ended in an error before its `end` event
DEFAULT_MIX = "normal=5,retried=2,interrupted=1,cancelled=1,tool=1"
MAX_REATTACHES = 3
MAX_TURNS = 1_000_000


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to run; built from the command line by :func:`plan_from_args`."""

    url: str
    turns: int
    rate: float  # turn starts per second
    concurrency: int
    mix: dict[str, int]
    tokens: int = 48
    tokens_per_s: float = 25.0
    timeout: float = 60.0  # per turn, from its POST to its `end`
    tool_name: str = "loadgen_probe"
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:8])

    def simulate(self, kind: str, index: int) -> dict[str, Any]:
        """The ``params.simulate`` knobs of one turn of ``kind``."""
        knobs: dict[str, Any] = {
            "seed": index,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
        }
        if kind == "retried":
            knobs["fail_before_first"] = 1
        elif kind == "interrupted":
            knobs["fail_after_deltas"] = self.tokens // 2
        elif kind == "cancelled":
            # Stopped after a quarter of --tokens deltas were read: a turn four times as long
            # is still streaming then, even when the machine holds its reader back a while.
            knobs["tokens"] = self.tokens * 4
        elif kind == "tool":
            after = self.tokens // 2
            knobs["tool_calls"] = [{"name": self.tool_name, "args": {"n": index}, "after": after}]
        return knobs

    @property
    def cancel_after_deltas(self) -> int:
        """A cancelled turn is stopped once this many of its deltas have been read."""
        return max(1, self.tokens // 4)


@dataclasses.dataclass
class TurnResult:
    """What one turn did, as seen by its reader."""

    index: int
    kind: str
    turn_id: str
    status: str = NO_END  # the `end` event's status
    first_delta_s: float | None = None  # from the POST to the first delta read
    deltas: int = 0
    reattaches: int = 0
    error_codes: list[str] = dataclasses.field(default_factory=list)  # `error` events
    tool_errors: list[str] = dataclasses.field(default_factory=list)  # `tool_result` errors
    error: str | None = None  # what went wrong on the load generator's side

    @property
    def expected(self) -> bool:
        return self.status == EXPECTED[self.kind]


@dataclasses.dataclass
class Summary:
    """The results of a run, in the order the turns finished."""

    plan: Plan
    results: list[TurnResult]
    elapsed_s: float

    @property
    def errors(self) -> int:
        return sum(1 for r in self.results if r.error is not None)

    @property
    def unexpected(self) -> int:
        """Turns that reached an ``end`` whose status is not the one their kind aims at."""
        return sum(1 for r in self.results if r.status != NO_END and not r.expected)

    def by_status(self) -> dict[str, int]:
        counts = Counter(r.status for r in self.results)
        return {s: counts[s] for s in (*STATUSES, NO_END) if counts[s] or s in STATUSES}

    def by_kind(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = {}
        for kind in KINDS:
            counts = Counter(r.status for r in self.results if r.kind == kind)
            if counts:
                table[kind] = {s: counts[s] for s in (*STATUSES, NO_END)}
        return table

    def first_delta_ms(self) -> dict[str, float | int | None]:
        samples = sorted(r.first_delta_s for r in self.results if r.first_delta_s is not None)
        return {
            "n": len(samples),
            "p50": _ms(percentile(samples, 50)),
            "p99": _ms(percentile(samples, 99)),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.plan.run_id,
            "url": self.plan.url,
            "planned": self.plan.turns,
            "finished": len(self.results),
            "elapsed_s": round(self.elapsed_s, 3),
            "by_status": self.by_status(),
            "by_kind": self.by_kind(),
            "unexpected": self.unexpected,
            "first_delta_ms": self.first_delta_ms(),
            "error_events": _counts(c for r in self.results for c in r.error_codes),
            "tool_errors": _counts(c for r in self.results for c in r.tool_errors),
            "reattaches": sum(r.reattaches for r in self.results),
            "errors": self.errors,
            "error_messages": _counts(r.error for r in self.results if r.error is not None),
        }

    def render(self) -> str:
        """The human-readable report printed at the end of a run."""
        d = self.to_dict()
        rate = len(self.results) / self.elapsed_s if self.elapsed_s > 0 else 0.0
        lines = [
            f"loadgen {d['run_id']}: {d['finished']}/{d['planned']} turns against {d['url']} "
            f"in {self.elapsed_s:.1f} s ({rate:.1f} turns/s)",
            "",
            f"{'kind':<12}{'turns':>7}"
            + "".join(f"{s:>13}" for s in (*STATUSES, NO_END))
            + "   expected",
        ]
        for kind, counts in d["by_kind"].items():
            lines.append(
                f"{kind:<12}{sum(counts.values()):>7}"
                + "".join(f"{counts[s]:>13}" for s in (*STATUSES, NO_END))
                + f"   {EXPECTED[kind]}"
            )
        totals = d["by_status"]
        lines.append(
            f"{'all':<12}{len(self.results):>7}"
            + "".join(f"{totals.get(s, 0):>13}" for s in (*STATUSES, NO_END))
        )
        ttfd = d["first_delta_ms"]
        lines += [
            "",
            f"unexpected outcomes  {d['unexpected']}",
            f"first delta          p50 {_fmt_ms(ttfd['p50'])}  p99 {_fmt_ms(ttfd['p99'])}"
            f"  (n={ttfd['n']})",
            f"error events         {_fmt_counts(d['error_events'])}",
            f"tool errors          {_fmt_counts(d['tool_errors'])}",
            f"reattaches           {d['reattaches']}",
            f"errors               {d['errors']}",
        ]
        for message, count in list(d["error_messages"].items())[:5]:
            lines.append(f"  {count} x {message}")
        return "\n".join(lines) + "\n"


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values; None when there are none."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def schedule(mix: dict[str, int], turns: int) -> list[str]:
    """The kind of each turn: each kind's share rounded by largest remainder, spread evenly.

    Deterministic, so ``--turns 10`` with weights ``2,2,2,2,2`` gives exactly two of each.
    """
    total = sum(mix.values())
    exact = {kind: turns * weight / total for kind, weight in mix.items()}
    counts = {kind: math.floor(share) for kind, share in exact.items()}
    by_remainder = sorted(mix, key=lambda k: (counts[k] - exact[k], KINDS.index(k)))
    for kind in by_remainder[: turns - sum(counts.values())]:
        counts[kind] += 1
    # Smooth weighted round-robin over the counts themselves picks each kind exactly that often.
    current = dict.fromkeys(counts, 0)
    order: list[str] = []
    for _ in range(turns):
        for kind, count in counts.items():
            current[kind] += count
        chosen = max(current, key=lambda k: (current[k], -KINDS.index(k)))
        current[chosen] -= turns
        order.append(chosen)
    return order


def parse_mix(text: str) -> dict[str, int]:
    """``"normal=5,retried=2,tool"`` as weights by kind (a bare kind weighs 1)."""
    mix: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, weight = item.partition("=")
        kind = kind.strip()
        if kind not in KINDS:
            close = difflib.get_close_matches(kind, KINDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown turn kind {kind!r}{hint}; known: {', '.join(KINDS)}")
        try:
            value = int(weight) if weight else 1
        except ValueError:
            raise ValueError(f"the weight of {kind} must be an integer, not {weight!r}") from None
        if value < 0:
            raise ValueError(f"the weight of {kind} must not be negative")
        mix[kind] = mix.get(kind, 0) + value
    mix = {kind: weight for kind, weight in mix.items() if weight > 0}
    if not mix:
        raise ValueError("the mix needs at least one kind with a positive weight")
    return mix


class Progress:
    """One status line on a terminal, redrawn in place with ``\\r`` (at most ten times a second)."""

    def __init__(self, stream: TextIO, total: int, enabled: bool) -> None:
        self.stream = stream
        self.total = total
        self.enabled = enabled
        self.started = time.monotonic()
        self.done = 0
        self.errors = 0
        self.statuses: Counter[str] = Counter()
        self._drawn_at = 0.0
        self._width = 0

    def add(self, result: TurnResult) -> None:
        self.done += 1
        self.statuses[result.status] += 1
        self.errors += result.error is not None
        self.draw()

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._drawn_at < 0.1):
            return
        self._drawn_at = now
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        filled = int(20 * self.done / self.total) if self.total else 20
        counts = " ".join(f"{s}={n}" for s, n in sorted(self.statuses.items()))
        line = (
            f"[{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total}"
            f"  {rate:.1f} turns/s  {counts or '-'}  errors={self.errors}"
        )
        padding = " " * max(0, self._width - len(line))  # wipe what a longer line left
        self._width = len(line)
        self.stream.write(f"\r{line}{padding}")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self.draw(force=True)
            self.stream.write("\n")
            self.stream.flush()


async def drive(plan: Plan, progress: Progress, results: list[TurnResult]) -> None:
    """Start ``plan.turns`` turns at ``plan.rate``, appending each to ``results`` as it ends."""
    kinds = schedule(plan.mix, plan.turns)
    slots = asyncio.Semaphore(plan.concurrency)
    limits = httpx.Limits(max_connections=2 * plan.concurrency + 2)
    timeout = httpx.Timeout(10.0, read=plan.timeout)
    async with httpx.AsyncClient(
        base_url=plan.url, timeout=timeout, limits=limits, trust_env=False, follow_redirects=False
    ) as client:

        async def one(index: int, kind: str) -> None:
            try:
                result = await run_turn(client, plan, index, kind)
            finally:
                slots.release()
            results.append(result)
            progress.add(result)

        async def ticker() -> None:
            while True:  # keeps the rate fresh while turns are slow to end
                progress.draw()
                await asyncio.sleep(0.25)

        loop = asyncio.get_running_loop()
        start = loop.time()
        tick = asyncio.create_task(ticker())
        try:
            async with asyncio.TaskGroup() as group:
                for index, kind in enumerate(kinds):
                    delay = start + index / plan.rate - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await slots.acquire()
                    group.create_task(one(index, kind))
        finally:
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick


async def run_turn(client: httpx.AsyncClient, plan: Plan, index: int, kind: str) -> TurnResult:
    """Start one turn and read its stream to the end; failures are recorded, never raised."""
    turn_id = f"loadgen-{plan.run_id}-{index:06d}"
    result = TurnResult(index, kind, turn_id)
    began = time.monotonic()
    cancel: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(plan.timeout):
            body = {
                "conversation_id": turn_id,  # one per turn, so retry budgets are per turn
                "turn_id": turn_id,
                "messages": [{"role": "user", "content": f"loadgen {kind} turn {index}"}],
                "params": {"simulate": plan.simulate(kind, index)},
            }
            response = await client.post("/v1/turns", json=body)
            if response.status_code not in (200, 201):
                result.error = f"POST /v1/turns answered {response.status_code}"
                return result
            stream_id = str(response.json()["stream_id"])
            last_id: str | None = None
            while True:
                headers = {"Accept": "text/event-stream"}
                if last_id is not None:
                    headers["Last-Event-ID"] = last_id
                async with client.stream(
                    "GET", f"/v1/streams/{stream_id}", headers=headers
                ) as stream:
                    if stream.status_code == 204:  # past the final `end`: ask the turn
                        result.status = await _turn_status(client, turn_id)
                        return result
                    if stream.status_code != 200:
                        result.error = f"GET /v1/streams answered {stream.status_code}"
                        return result
                    async for event, data, event_id in _sse(stream):
                        last_id = event_id or last_id
                        if event == "delta":
                            result.deltas += 1
                            if result.first_delta_s is None:
                                result.first_delta_s = time.monotonic() - began
                            wanted = plan.cancel_after_deltas
                            if kind == "cancelled" and cancel is None and result.deltas >= wanted:
                                cancel = asyncio.create_task(_cancel(client, turn_id))
                        elif event == "error":
                            result.error_codes.append(str(data.get("code", "?")))
                        elif event == "tool_result" and isinstance(data.get("error"), dict):
                            result.tool_errors.append(str(data["error"].get("code", "?")))
                        elif event == "end":
                            result.status = str(data.get("status", "?"))
                            return result
                if result.reattaches >= MAX_REATTACHES:
                    result.error = "stream cut without an end event, reattaches exhausted"
                    return result
                result.reattaches += 1
    except TimeoutError:
        result.error = f"no end event within {plan.timeout:g} s"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    except (ValueError, KeyError) as exc:
        result.error = f"unreadable answer: {type(exc).__name__}"
    finally:
        if cancel is not None:
            try:
                await cancel
            except httpx.HTTPError as exc:
                result.error = result.error or f"cancel failed: {type(exc).__name__}"
    return result


async def _cancel(client: httpx.AsyncClient, turn_id: str) -> None:
    response = await client.post(f"/v1/turns/{turn_id}/cancel")
    response.raise_for_status()


async def _turn_status(client: httpx.AsyncClient, turn_id: str) -> str:
    response = await client.get(f"/v1/turns/{turn_id}")
    response.raise_for_status()
    return str(response.json()["status"])


async def _sse(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any], str | None]]:
    """Yield ``(event, data, id)`` for each SSE event with data, decoded by the client's own
    :class:`~broker_client.sse.SSEDecoder` (comments and data-less blocks are not events)."""
    decoder = SSEDecoder()
    async for chunk in response.aiter_bytes():
        for event in decoder.feed(chunk):
            parsed = json.loads(event.data)
            if not isinstance(parsed, dict):
                raise ValueError("an event's data is not a JSON object")
            yield event.event, parsed, event.id or None


def add_parser(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``broker loadgen`` on the CLI's subcommands."""
    parser = subcommands.add_parser(
        "loadgen",
        help="drive a running broker with a mix of simulated turns",
        description="Drive a running broker with a bounded mix of simulated turns, read each "
        "to its end over SSE, and print what happened.",
    )
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the broker (default %(default)s)"
    )
    parser.add_argument("--rate", type=float, default=5.0, help="turn starts per second (5)")
    bound = parser.add_mutually_exclusive_group()
    bound.add_argument("--turns", type=int, help="how many turns to run")
    bound.add_argument(
        "--duration", type=float, default=10.0, help="seconds of starts: rate x duration turns (10)"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="turns open at once (32)")
    parser.add_argument(
        "--mix", default=DEFAULT_MIX, help=f"weights by kind of turn ({DEFAULT_MIX})"
    )
    parser.add_argument("--tokens", type=int, default=48, help="deltas per answer (48, >= 4)")
    parser.add_argument(
        "--tokens-per-s", type=float, default=25.0, help="pace of deltas, 0 = no pause (25)"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per turn (60)")
    parser.add_argument(
        "--tool-name",
        default="loadgen_probe",
        help="the tool `tool` turns call; a registered tool of that name really runs",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the progress line on stderr (default: when stderr is a terminal)",
    )


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Check the arguments; a ``ValueError`` names the one that is wrong."""
    url = str(args.url).rstrip("/")
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--url must be an http:// or https:// URL, not {args.url!r}")
    if not 0 < args.rate <= 10_000:
        raise ValueError("--rate must be more than 0 and at most 10000")
    turns = args.turns if args.turns is not None else math.ceil(args.rate * args.duration)
    if args.turns is None and args.duration <= 0:
        raise ValueError("--duration must be positive")
    if not 1 <= turns <= MAX_TURNS:
        raise ValueError(f"the run must have from 1 to {MAX_TURNS} turns, not {turns}")
    if args.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    if not 4 <= args.tokens <= 100_000:
        raise ValueError("--tokens must be from 4 to 100000")
    if not 0 <= args.tokens_per_s <= 1_000_000:
        raise ValueError("--tokens-per-s must be from 0 to 1000000")
    if args.timeout <= 0:
        raise ValueError("--timeout must be positive")
    return Plan(
        url=url,
        turns=turns,
        rate=args.rate,
        concurrency=args.concurrency,
        mix=parse_mix(args.mix),
        tokens=args.tokens,
        tokens_per_s=args.tokens_per_s,
        timeout=args.timeout,
        tool_name=args.tool_name,
    )


def run(args: argparse.Namespace) -> int:
    """``broker loadgen``: 0 when every turn ended as its kind aims at, 1 otherwise, 2 bad args.

    Ctrl-C stops the run and still prints the summary of the turns that ended.
    """
    try:
        plan = plan_from_args(args)
    except ValueError as exc:
        print(f"broker loadgen: {exc}", file=sys.stderr)
        return 2
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = Progress(sys.stderr, plan.turns, show)
    results: list[TurnResult] = []
    began = time.monotonic()
    stopped = False
    try:
        asyncio.run(drive(plan, progress, results))
    except KeyboardInterrupt:
        stopped = True
    progress.finish()
    summary = Summary(plan, results, time.monotonic() - began)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        sys.stdout.write(summary.render())
    if stopped:
        print("broker loadgen: stopped before the end", file=sys.stderr)
        return 130
    ok = len(results) == plan.turns and summary.errors == 0 and summary.unexpected == 0
    return 0 if ok else 1


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _fmt_ms(value: float | int | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _counts(items: Iterable[str]) -> dict[str, int]:
    return dict(Counter(items).most_common())


def _fmt_counts(counts: dict[str, int]) -> str:
    return "  ".join(f"{name} {n}" for name, n in counts.items()) or "-"
