"""One attempt of a turn, from its first upstream call to its ``end`` event.

Before the first delta a retryable failure is retried silently (nothing reaches the stream: the
``attempt`` event is written together with the first delta), within the limits of
:class:`~broker.retry.RetryPolicy`. After the first delta nothing is automatic: a failure ends the
attempt ``interrupted`` with its partial text, and the user chooses ``continue`` or
``regenerate``. A stop, a lost lease and a shutdown reach the running attempt as a cancellation
whose cause is recorded on its :class:`Run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, Final

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from broker import redis_calls as rc
from broker.errors import FencedWrite, StopRequested, StreamFull
from broker.keys import Keys
from broker.lease import ATTEMPT_STATUS, Claim, TurnWriter
from broker.ledger import Dispatcher, Outcome, Slot
from broker.metrics import Metrics
from broker.providers import (
    Finished,
    GenerationRequest,
    Provider,
    Providers,
    TextDelta,
    ToolCallChunk,
    ToolCallEnd,
    ToolStep,
    UpstreamError,
    Usage,
)
from broker.retry import RetryPolicy
from broker.settings import Settings

log = logging.getLogger("broker.generation")

# Why a running attempt was cancelled from outside.
STOP: Final = "cancelled"
SHUTDOWN: Final = "shutdown"
LEASE_LOST: Final = "lease_lost"
PROMOTED_STATUSES = frozenset({"complete", "interrupted", "cancelled"})


class LeaseLost(Exception):
    """The attempt's lease was taken over: it must write nothing more."""


@dataclasses.dataclass
class Run:
    """A running attempt as its worker sees it: what to cancel, and why it was cancelled."""

    conversation_id: str
    turn_id: str
    attempt: int
    job_id: str
    writer: TurnWriter
    claim: Claim
    stop: str | None = None
    task: asyncio.Task[None] | None = None
    slot_refreshed: float = dataclasses.field(default_factory=time.monotonic)

    def request_stop(self, reason: str) -> None:
        """Cancel the attempt's task once, remembering why.

        The attempt also looks at ``stop`` at each step (:meth:`Generation._check_stop`): a
        cancellation that lands while redis-py awaits a reply can be swallowed.
        """
        if self.stop is None and self.task is not None and not self.task.done():
            self.stop = reason
            self.task.cancel(msg=reason)


class _ToolFailure(Exception):
    """A tool call's outcome fails the turn (unknown outcome, in-flight timeout, mismatch)."""

    def __init__(self, reason: str, error: dict[str, Any]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


# Deltas queued behind an append in flight before the model has to wait for Redis.
MAX_QUEUED_DELTAS = 512


class _Retry(Exception):
    def __init__(
        self, reason: str, error: dict[str, Any], retry_after_s: float | None = None
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error
        self.retry_after_s = retry_after_s


class Generation:
    """Runs one attempt to its end; see the module docstring for the rules."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        settings: Settings,
        providers: Providers,
        metrics: Metrics,
        retry: RetryPolicy,
        run: Run,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._settings = settings
        self._providers = providers
        self._metrics = metrics
        self._retry = retry
        self._run = run
        self._turn_key = keys.turn(run.conversation_id, run.turn_id)
        self._writer = run.writer
        self._n = run.attempt
        self._request: dict[str, Any] = {}
        self._record: dict[str, Any] = {}
        self._session = run.conversation_id
        self._prefix = ""
        self._parts: list[str] = []
        self._has_attempt_event = False
        self._tool_output = False
        self._ordinals: dict[str, int] = {}
        self._dispatcher = dispatcher
        self._pending_usage: tuple[str, dict[str, Any]] | None = None
        self._usage: dict[str, int] | None = None
        self._stream_id: str | None = None
        self.started = False
        self.handed_back = False  # stopped by a shutdown before any output: see _hand_back
        # Deltas waiting for their append, and the one task appending them (a group commit).
        self._queued: list[tuple[str, dict[str, Any]]] = []
        self._queued_text: list[str] = []
        self._flusher: asyncio.Task[None] | None = None
        self._flush_error: BaseException | None = None

    def _check_stop(self) -> None:
        """Raise the cancellation a stop, a lost lease or a shutdown sent, if it never arrived.

        redis-py can swallow a ``CancelledError`` that lands while a reply is awaited; the
        reason recorded on the run is looked at after every step instead, so the attempt ends
        as it would have had the cancellation arrived.
        """
        if self._run.stop is not None:
            raise asyncio.CancelledError(self._run.stop)

    @property
    def _text(self) -> str:
        return self._prefix + "".join(self._parts)

    async def run(self) -> None:
        """Run the attempt; raises LeaseLost when it must stop without writing."""
        self.started = True
        try:
            await self._run_guarded()
        except FencedWrite as exc:  # also from the handlers' own last writes
            raise LeaseLost() from exc
        finally:
            if self._flusher is not None and not self._flusher.done():
                # The attempt ended without its last writes. Emptied too, so that a flusher
                # whose cancellation redis-py swallowed appends nothing more.
                self._queued, self._queued_text = [], []
                self._flusher.cancel()

    async def end_unstarted(self, stop: str) -> None:
        """End an attempt whose task was stopped before it ran a single step."""
        try:
            await self._load()
            if stop == STOP:
                await self._finish("cancelled", "cancelled")
            elif stop == SHUTDOWN and not await self._hand_back():
                await self._interrupt("shutdown")
        except FencedWrite as exc:
            raise LeaseLost() from exc

    async def _run_guarded(self) -> None:
        try:
            await self._load()
            await self._run_attempt()
        except (LeaseLost, FencedWrite):
            raise
        except StopRequested:
            await self._finish("cancelled", "cancelled")
        except asyncio.CancelledError:
            if self._run.stop == STOP:
                await self._finish("cancelled", "cancelled")
                return  # the stop is handled: the attempt ended as the user asked
            if self._run.stop == SHUTDOWN and not await self._hand_back():
                await self._interrupt("shutdown")
            raise
        except StreamFull:
            await self._finish(
                "failed",
                "stream_limit",
                error={
                    "code": "stream_limit",
                    "retryable": False,
                    "message": "the stream reached BROKER_MAX_STREAM_EVENTS="
                    f"{self._settings.max_stream_events}",
                },
            )
        except (RedisError, OSError):
            raise  # Redis away: the job stays pending and a worker takes the turn over
        except Exception:
            log.exception("turn %s attempt %d failed inside the broker", self._run.turn_id, self._n)
            await self._finish(
                "failed",
                "internal",
                error={
                    "code": "internal",
                    "retryable": False,
                    "message": "the broker failed this attempt",
                },
            )

    async def _hand_back(self) -> bool:
        """At shutdown, give back an attempt of which nothing reached a reader yet.

        Its lease is released and its job stays pending: the next worker takes the turn over
        and retries it silently (within the retry limits), as after a crash before the first
        delta, instead of the user finding an empty interrupted answer. False when something
        was delivered (the attempt is interrupted) or the lease is no longer this worker's.
        """
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()  # what it had not appended was never delivered
            await asyncio.wait([self._flusher])
        _, delivered, tool_output = await self._delivered()
        if delivered or tool_output or not await self._writer.release():
            return False
        self.handed_back = True
        log.info(
            "turn %s attempt %d: nothing delivered yet; handed back for another worker to retry",
            self._run.turn_id,
            self._n,
        )
        return True

    async def _load(self) -> None:
        raw_request, raw_record, session, stream_id = await rc.hmget(
            self._redis, self._turn_key, ["request", f"attempt:{self._n}", "session", "stream_id"]
        )
        self._stream_id = stream_id
        self._request = orjson.loads(raw_request or "{}")
        self._record = orjson.loads(raw_record or "{}") or {"n": self._n, "strategy": "initial"}
        self._session = session or self._run.conversation_id
        if self._record.get("strategy") == "continue":
            (prefix,) = await rc.hmget(
                self._redis, self._turn_key, [f"text:{self._record.get('from')}"]
            )
            self._prefix = prefix or ""

    async def _run_attempt(self) -> None:
        claim = self._run.claim
        delivered_before = ""
        if claim.previous_status == "streaming":
            self._metrics.lease_takeovers.inc()
            self._has_attempt_event, delivered_before, self._tool_output = await self._delivered()
            self._parts = [delivered_before] if delivered_before else []
        if claim.stop_requested:
            await self._finish("cancelled", "cancelled")
            return
        if self._output:
            # A dead worker's answer already reached readers: never continue it silently.
            log.info("turn %s: took over after a lost worker; interrupting", self._run.turn_id)
            await self._interrupt("worker_lost")
            return
        reason = "worker_lost" if claim.previous_status == "streaming" else None
        last_error: dict[str, Any] = {}
        retry_after: float | None = None
        while True:
            self._check_stop()
            calls = int(await self._redis.hincrby(self._turn_key, f"calls:{self._n}", 1))
            if calls > 1:  # this call is a retry: after a failure, or of a lost worker's call
                verdict = await self._retry.permit(self._session, calls - 1, reason or "")
                if verdict is not None:
                    detail = last_error.get("message", "the previous worker was lost")
                    await self._finish(
                        "failed",
                        verdict,
                        error={
                            "code": verdict,
                            "retryable": False,
                            "message": f"gave up after {calls - 1} upstream call(s): {detail}",
                        },
                    )
                    return
                await asyncio.sleep(self._retry.backoff_s(retry_after))
            self._check_stop()
            try:
                await self._call_upstream(calls - 1)
                return
            except _Retry as retry:
                reason, last_error, retry_after = retry.reason, retry.error, retry.retry_after_s

    async def _call_upstream(self, upstream_call: int) -> None:
        """One upstream call, and the tool steps it leads to, until the answer ends."""
        provider = self._providers.get(self._request.get("provider"))
        messages = list(self._request.get("messages", []))
        if self._prefix:
            messages.append({"role": "assistant", "content": self._prefix})
        steps: list[ToolStep] = []
        for _ in range(self._settings.max_tool_steps + 1):
            request = GenerationRequest(
                conversation_id=self._run.conversation_id,
                turn_id=self._run.turn_id,
                attempt=self._n,
                strategy=str(self._record.get("strategy", "initial")),
                messages=messages,
                model=self._providers.model_for(provider, self._request.get("model")),
                params=self._request.get("params", {}),
                response_format=self._request.get("response_format", "text"),
                upstream_call=upstream_call,
                tools=self._request.get("tools", []),
                tool_steps=list(steps),
            )
            step = await self._stream_step(provider, request)
            if step is None:
                return  # the attempt ended (or was handed to a retry) inside the step
            if not step.calls:
                break
            steps.append(step)
        else:
            await self._finish(
                "failed",
                "tool_steps_exhausted",
                error={
                    "code": "tool_steps_exhausted",
                    "retryable": False,
                    "message": f"the model kept calling tools for BROKER_MAX_TOOL_STEPS="
                    f"{self._settings.max_tool_steps} steps",
                },
            )
            return
        if request.response_format == "json":
            try:
                orjson.loads(self._text)
            except orjson.JSONDecodeError as exc:
                await self._finish(
                    "failed",
                    "invalid_output",
                    error={
                        "code": "invalid_output",
                        "retryable": False,
                        "message": f"the answer is not valid JSON: {exc}",
                    },
                )
                return
        await self._finish("complete", None)

    async def _stream_step(self, provider: Provider, request: GenerationRequest) -> ToolStep | None:
        """Stream one model message; its tool calls run as soon as their arguments are whole.

        Returns the step (text, calls, results) when the message ended, None when the attempt
        ended inside it. Raises _Retry for a retryable failure before any output.
        """
        stream = provider.stream(request)
        began = time.monotonic()
        first_token = True
        outcome = "ok"
        finished = False
        step_start = len(self._parts)
        open_calls: dict[int, dict[str, str]] = {}
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        idle = self._settings.upstream_idle_timeout_s
        try:
            while True:
                try:
                    async with asyncio.timeout(idle):
                        event = await anext(stream)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise UpstreamError(
                        "upstream_timeout", f"no upstream event for {idle} s", retryable=True
                    ) from None
                self._check_stop()
                if isinstance(event, TextDelta) and event.text:
                    if first_token:
                        first_token = False
                        self._metrics.upstream_first_token_seconds.labels(provider.name).observe(
                            time.monotonic() - began
                        )
                    await self._queue_delta(event.text)
                elif isinstance(event, ToolCallChunk):
                    call = open_calls.setdefault(
                        event.index, {"id": "", "name": "", "arguments": ""}
                    )
                    call["id"] = event.call_id or call["id"]
                    call["name"] = event.name or call["name"]
                    call["arguments"] += event.arguments
                elif isinstance(event, ToolCallEnd) and event.index in open_calls:
                    await self._run_tool(open_calls.pop(event.index), calls, results)
                elif isinstance(event, Usage):
                    self._count_usage(event)
                    usage = (
                        "usage",
                        {
                            "attempt": self._n,
                            "input_tokens": event.input_tokens,
                            "output_tokens": event.output_tokens,
                        },
                    )
                    flushing = self._flusher is not None and not self._flusher.done()
                    if self._output or self._queued or flushing:
                        await self._append([usage])  # after the deltas it follows
                    else:
                        # Held back until the first output: a usage event alone would make
                        # the attempt visible before a silent retry.
                        self._pending_usage = usage
                elif isinstance(event, Finished):
                    for index in sorted(open_calls):  # the message's end completes its calls
                        await self._run_tool(open_calls.pop(index), calls, results)
                    finished = True
                    break
            await self._drain()
            if not finished:
                raise UpstreamError(
                    "upstream_incomplete",
                    "the upstream stream ended without its terminal event",
                    retryable=True,
                )
        except UpstreamError as exc:
            await self._drain()  # what was read before the failure counts as delivered
            delivered = self._output
            await self._abandon(open_calls, show=delivered)
            error = {"code": exc.code, "message": exc.message, "retryable": exc.retryable}
            timeout = exc.code == "upstream_timeout"
            if delivered:
                outcome = "interrupted"
                await self._interrupt("upstream_timeout" if timeout else "upstream_error", error)
                return None
            if exc.retryable:
                outcome = "retryable_error"
                self._pending_usage = None  # the failed call's usage is not this answer's
                self._usage = None
                reason = "upstream_timeout" if timeout else "upstream_error"
                raise _Retry(reason, error, exc.retry_after_s) from None
            outcome = "fatal_error"
            await self._finish("failed", exc.code, error=error)
            return None
        except _ToolFailure as failure:
            await self._finish(
                "failed", failure.reason, error={**failure.error, "retryable": False}
            )
            return None
        except asyncio.CancelledError:
            outcome = "cancelled" if self._run.stop == STOP else "interrupted"
            raise
        finally:
            await stream.aclose()  # an abort reaches the upstream call at once
            self._metrics.upstream_requests.labels(provider.name, request.model, outcome).inc()
        return ToolStep("".join(self._parts[step_start:]), calls, results)

    async def _run_tool(
        self, call: dict[str, str], calls: list[dict[str, Any]], results: list[dict[str, Any]]
    ) -> None:
        """Dispatch one complete call through the ledger and put both sides on the stream."""
        name = call["name"]
        ordinal = self._ordinals.get(name, 0)
        self._ordinals[name] = ordinal + 1
        call_id = call["id"] or f"call_{self._n}_{name}_{ordinal}"
        try:
            shown: Any = orjson.loads(call["arguments"] or "{}")
        except orjson.JSONDecodeError:
            shown = call["arguments"]
        await self._append(
            [
                (
                    "tool_call",
                    {
                        "attempt": self._n,
                        "call_id": call_id,
                        "name": name,
                        "args": shown,
                        "ordinal": ordinal,
                        "status": "dispatched",
                    },
                )
            ]
        )
        slot = Slot(self._run.conversation_id, self._run.turn_id, name, ordinal)
        row = {"tool": name, "ordinal": ordinal, "attempt": self._n, "call_id": call_id}
        if self._dispatcher is None:
            outcome = Outcome(
                "refused", error={"code": "unknown_tool", "message": "no tools are registered"}
            )
        else:
            outcome = await self._dispatcher.dispatch(
                slot, call["arguments"], row, self._writer.token
            )
        data: dict[str, Any] = {
            "attempt": self._n,
            "call_id": call_id,
            "name": name,
            "ordinal": ordinal,
            "source": outcome.source,
            "status": "error" if outcome.error else "ok",
        }
        if outcome.error is not None:
            data["error"] = outcome.error
        else:
            data["result"] = outcome.result
        await self._append([("tool_result", data)])
        if outcome.fail_reason is not None:
            raise _ToolFailure(outcome.fail_reason, outcome.error or {})
        calls.append({"id": call_id, "name": name, "arguments": call["arguments"]})
        content = outcome.error if outcome.error is not None else outcome.result
        results.append({"id": call_id, "name": name, "content": orjson.dumps(content).decode()})

    async def _abandon(self, open_calls: dict[int, dict[str, str]], *, show: bool) -> None:
        """Calls cut off while their arguments arrived: recorded as not run, never dispatched.

        Readers are told (``show``) only when the attempt already reached them; otherwise a
        silent retry follows and the stream stays as if nothing happened.
        """
        for index in sorted(open_calls):
            call = open_calls.pop(index)
            row = {
                "tool": call["name"],
                "attempt": self._n,
                "call_id": call["id"],
                "state": "not_run",
                "reason": "connection_lost",
                "partial_arguments": call["arguments"],
            }
            if self._dispatcher is not None:
                await self._dispatcher.ledger.abandon(
                    self._run.conversation_id, self._run.turn_id, row
                )
                tool = self._dispatcher.registry.get(call["name"])
                kind = tool.kind if tool is not None else "read"
                self._metrics.tool_calls.labels(kind, "not_run").inc()
            if not show:
                continue
            with contextlib.suppress(StopRequested, StreamFull):
                await self._append(
                    [
                        (
                            "tool_call",
                            {
                                "attempt": self._n,
                                "call_id": call["id"],
                                "name": call["name"],
                                "args": None,
                                "ordinal": None,
                                "status": "not_run",
                                "reason": "connection_lost",
                            },
                        )
                    ]
                )

    def _count_usage(self, event: Usage) -> None:
        """Sum the attempt's tokens over its tool steps, for its record."""
        so_far = self._usage or {"input_tokens": 0, "output_tokens": 0}
        self._usage = {
            "input_tokens": so_far["input_tokens"] + event.input_tokens,
            "output_tokens": so_far["output_tokens"] + event.output_tokens,
        }

    @property
    def _output(self) -> bool:
        """Whether anything of this attempt reached readers (text or tool events)."""
        return bool(self._parts) or self._tool_output

    async def _queue_delta(self, text: str) -> None:
        """Append a delta soon: deltas that arrive while an append is in flight go together in
        the next one. Readers see the same events either way; each is in Redis before any
        reader can see it, and the attempt's text only counts what was appended."""
        if self._flush_error is not None:
            await self._drain()  # raises it
        self._queued.append(("delta", {"attempt": self._n, "text": text}))
        self._queued_text.append(text)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="append deltas")
        elif len(self._queued) >= MAX_QUEUED_DELTAS:
            await self._drain()  # Redis is slower than the model: wait for it

    async def _flush(self) -> None:
        try:
            while self._queued:
                events, texts = self._queued, self._queued_text
                self._queued, self._queued_text = [], []
                await self._write(events)
                self._parts.extend(texts)
        except Exception as exc:  # handed to the generation at its next step
            self._flush_error = exc
            self._queued, self._queued_text = [], []

    async def _drain(self) -> None:
        """Wait until every queued delta is appended; raise what stopped an append."""
        flusher = self._flusher
        if flusher is not None and not flusher.done():
            # asyncio.wait: a cancelled caller must not cancel the append it waits for.
            await asyncio.wait([flusher])
        error, self._flush_error = self._flush_error, None
        if error is not None:
            raise error

    async def _append(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        await self._drain()  # queued deltas go first: the stream keeps its order
        await self._write(events)

    async def _write(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        if self._pending_usage is not None:
            events = [self._pending_usage, *events]
            self._pending_usage = None
        if not self._has_attempt_event:
            # The attempt becomes visible with its first output, so silent retries stay silent.
            events = [self._attempt_event(), *events]
        await self._writer.append(events)
        self._has_attempt_event = True
        if any(kind in ("tool_call", "tool_result") for kind, _ in events):
            self._tool_output = True

    def _attempt_event(self) -> tuple[str, dict[str, Any]]:
        return ("attempt", {"attempt": self._n, "strategy": self._record.get("strategy")})

    async def _interrupt(self, reason: str, error: dict[str, Any] | None = None) -> None:
        self._metrics.interruptions.labels(reason).inc()
        await self._finish("interrupted", reason, error=error)

    async def _finish(
        self, status: str, reason: str | None, *, error: dict[str, Any] | None = None
    ) -> None:
        # The end comes after every delta; deltas a stop or a full stream refused stay out.
        with contextlib.suppress(StopRequested, StreamFull):
            await self._drain()
        before: list[tuple[str, dict[str, Any]]] = []
        if not self._has_attempt_event:
            before.append(self._attempt_event())
        if self._pending_usage is not None:
            before.append(self._pending_usage)
            self._pending_usage = None
        if error is not None:
            before.append(("error", {"attempt": self._n, **error}))
        text = self._text
        promote = status in PROMOTED_STATUSES and bool(text)
        if self._usage is not None:
            self._record = {**self._record, "usage": self._usage}
        base = str(self._record.get("base", ""))
        promoted = await self._writer.finish(
            record=self._record,
            status=status,
            reason=reason,
            text=text,
            promote=promote,
            base=base,
            before_end=before,
        )
        if promoted == -1:
            log.warning(
                "turn %s attempt %d: canonical changed meanwhile; not promoted",
                self._run.turn_id,
                self._n,
            )
        strategy = str(self._record.get("strategy", "initial"))
        self._metrics.attempts.labels(strategy, ATTEMPT_STATUS[status]).inc()
        log.info(
            "turn %s attempt %d ended %s%s",
            self._run.turn_id,
            self._n,
            status,
            f" ({reason})" if reason else "",
            extra={
                "turn_id": self._run.turn_id,
                "conversation_id": self._run.conversation_id,
                "stream_id": self._stream_id,
                "attempt": self._n,
                "strategy": strategy,
                "status": status,
                "reason": reason,
                "event": "attempt_ended",
            },
        )

    async def _delivered(self) -> tuple[bool, str, bool]:
        """Whether this attempt's ``attempt`` event is on the stream, its delivered text, and
        whether tool events were delivered."""
        key = self._keys.events(self._run.conversation_id, self._run.turn_id)
        has_attempt_event = tool_output = False
        text: list[str] = []
        start = "-"
        while True:
            page = await rc.xrange(self._redis, key, start)
            if not page:
                break
            for _entry_id, fields in page:
                data = orjson.loads(fields.get("d", "{}"))
                if data.get("attempt") != self._n:
                    continue
                if fields.get("e") == "attempt":
                    has_attempt_event = True
                elif fields.get("e") == "delta":
                    text.append(str(data.get("text", "")))
                elif fields.get("e") in ("tool_call", "tool_result"):
                    tool_output = True
            start = "(" + page[-1][0]
        return has_attempt_event, "".join(text), tool_output
