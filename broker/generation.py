"""One attempt of a turn, from its first upstream call to its ``end`` event.

Before the first delta a retryable failure is retried silently (nothing reaches the stream: the
``attempt`` event is written together with the first delta), within the limits of
:class:`~broker.retry.RetryPolicy`. After the first delta nothing is automatic: a failure ends the
attempt ``interrupted`` with its partial text, and the user chooses ``continue`` or
``regenerate``. A stop, a lost lease and a shutdown reach the running attempt as a cancellation
whose cause is recorded on its :class:`Run`; since redis-py can swallow that cancellation, the
attempt also looks at the recorded cause after every step (:meth:`Generation._check_stop`).

What reaches the stream, and in which order, is :class:`~broker.output.AttemptOutput`'s; the
tool calls are :class:`~broker.tool_steps.ToolSteps`'. This module keeps the attempt's flow: load
it, call upstream (again, when a silent retry is allowed), and finish it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, Final

import orjson
from redis.exceptions import RedisError

from broker import redis_calls as rc
from broker.deps import Deps
from broker.errors import FencedWrite, LeaseLost, StopRequested, StreamFull
from broker.lease import TurnWriter
from broker.ledger import Dispatcher
from broker.metrics import error_code
from broker.output import AttemptOutput
from broker.providers import (
    Finished,
    GenerationRequest,
    Provider,
    ProviderEvent,
    Providers,
    TextDelta,
    ToolCallChunk,
    ToolCallEnd,
    ToolStep,
    UpstreamError,
    Usage,
)
from broker.retry import RetryPolicy
from broker.scripts import Claim
from broker.structured_output import output_problem
from broker.tool_steps import ToolCalls, ToolFailure, ToolSteps
from broker.vocabulary import ATTEMPT_STATUS, PROMOTED_STATUSES, TurnStatus

log = logging.getLogger("broker.generation")

# The events of an attempt's tool calls (output that reached readers, as its text is).
TOOL_EVENTS: Final = ("tool_call", "tool_input_delta", "tool_result")
# Why a running attempt was cancelled from outside.
STOP: Final = "cancelled"
SHUTDOWN: Final = "shutdown"
LEASE_LOST: Final = "lease_lost"


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
        deps: Deps,
        providers: Providers,
        retry: RetryPolicy,
        run: Run,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        self._deps = deps
        self._redis = deps.redis
        self._settings = deps.settings
        self._metrics = deps.metrics
        self._providers = providers
        self._retry = retry
        self._run = run
        self._turn_key = deps.keys.turn(run.conversation_id, run.turn_id)
        self._writer = run.writer
        self._n = run.attempt
        self._request: dict[str, Any] = {}
        self._record: dict[str, Any] = {}
        self._session = run.conversation_id
        self._prefix = ""
        self._usage: dict[str, int] | None = None
        self._stream_id: str | None = None
        self._output = AttemptOutput(
            run.writer,
            run.attempt,
            linger_s=deps.settings.append_linger_ms / 1000,
            burst=deps.settings.append_burst_deltas,
        )
        self._tools = ToolSteps(
            run.conversation_id,
            run.turn_id,
            run.attempt,
            self._output,
            run.writer,
            deps.metrics,
            dispatcher,
        )
        self.started = False
        self.handed_back = False  # stopped by a shutdown before any output: see _hand_back

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
        return self._prefix + self._output.text

    async def run(self) -> None:
        """Run the attempt; raises LeaseLost when it must stop without writing."""
        self.started = True
        try:
            await self._run_guarded()
        except FencedWrite as exc:  # also from the handlers' own last writes
            raise LeaseLost() from exc
        finally:
            # If the attempt ended without its last writes, a flusher still running is emptied
            # too, so that one whose cancellation redis-py swallowed appends nothing more.
            self._output.close()

    async def end_unstarted(self, stop: str) -> None:
        """End an attempt whose task was stopped before it ran a single step."""
        try:
            await self._load()
            if stop == STOP:
                await self._finish(TurnStatus.CANCELLED, "cancelled")
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
            await self._finish(TurnStatus.CANCELLED, "cancelled")
        except asyncio.CancelledError:
            if self._run.stop == STOP:
                await self._finish(TurnStatus.CANCELLED, "cancelled")
                return  # the stop is handled: the attempt ended as the user asked
            if self._run.stop == SHUTDOWN and not await self._hand_back():
                await self._interrupt("shutdown")
            raise
        except StreamFull:
            await self._fail(
                "stream_limit",
                f"the stream reached BROKER_MAX_STREAM_EVENTS={self._settings.max_stream_events}",
            )
        except (RedisError, OSError):
            raise  # Redis away: the job stays pending and a worker takes the turn over
        except Exception:
            log.exception("turn %s attempt %d failed inside the broker", self._run.turn_id, self._n)
            await self._fail("internal", "the broker failed this attempt")

    async def _hand_back(self) -> bool:
        """At shutdown, give back an attempt of which nothing reached a reader yet.

        Its lease is released and its job stays pending: the next worker takes the turn over
        and retries it silently (within the retry limits), as after a crash before the first
        delta, instead of the user finding an empty interrupted answer. False when something
        was delivered (the attempt is interrupted) or the lease is no longer this worker's.
        """
        await self._output.abandon_queued()  # what it had not appended was never delivered
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
        self._output.strategy = self._record.get("strategy")
        self._session = session or self._run.conversation_id
        if self._record.get("strategy") == "continue":
            (prefix,) = await rc.hmget(
                self._redis, self._turn_key, [f"text:{self._record.get('from')}"]
            )
            self._prefix = prefix or ""

    async def _run_attempt(self) -> None:
        claim = self._run.claim
        if claim.previous_status == TurnStatus.STREAMING:
            self._metrics.lease_takeovers.inc()
            has_attempt_event, delivered_before, tool_output = await self._delivered()
            self._output.resume(
                has_attempt_event=has_attempt_event, text=delivered_before, tool_output=tool_output
            )
        if claim.stop_requested:
            await self._finish(TurnStatus.CANCELLED, "cancelled")
            return
        parked = self._record.pop("parked", None)
        if parked is not None and claim.previous_status != TurnStatus.STREAMING:
            # Its approvals were decided: go on from where it waited (what it showed stays).
            has_attempt_event, delivered_before, _ = await self._delivered()
            self._output.resume(
                has_attempt_event=has_attempt_event, text=delivered_before, tool_output=True
            )
            self._usage = parked.get("usage")
            await self._call_upstream(int(parked.get("upstream_call", 0)), parked)
            return
        if self._output.reached_readers:
            # A dead worker's answer already reached readers: never continue it silently.
            log.info("turn %s: took over after a lost worker; interrupting", self._run.turn_id)
            await self._interrupt("worker_lost")
            return
        # A call counted before this worker's first one was a lost worker's.
        reason = "worker_lost"
        last_error: dict[str, Any] = {}
        retry_after: float | None = None
        while True:
            self._check_stop()
            calls = int(await self._redis.hincrby(self._turn_key, f"calls:{self._n}", 1))
            if calls > 1:  # this call is a retry: after a failure, or of a lost worker's call
                verdict = await self._retry.permit(
                    self._session, calls - 1, reason, last_error.get("code")
                )
                if verdict is not None:
                    detail = last_error.get("message", "the previous worker was lost")
                    await self._fail(
                        verdict,
                        f"gave up after {calls - 1} upstream call(s): {detail}",
                        upstream_code=last_error.get("code"),
                    )
                    return
                await asyncio.sleep(self._retry.backoff_s(retry_after))
            self._check_stop()
            try:
                await self._call_upstream(calls - 1)
                return
            except _Retry as retry:
                reason, last_error, retry_after = retry.reason, retry.error, retry.retry_after_s

    async def _call_upstream(
        self, upstream_call: int, parked: dict[str, Any] | None = None
    ) -> None:
        """One upstream call, and the tool steps it leads to, until the answer ends; with
        ``parked``, the attempt goes on from where it waited for approvals."""
        provider = self._providers.get(self._request.get("provider"))
        client_tools: list[dict[str, Any]] = self._request.get("client_tools", [])
        self._tools.restart(frozenset(tool["name"] for tool in client_tools))
        messages = list(self._request.get("messages", []))
        if self._prefix:
            messages.append({"role": "assistant", "content": self._prefix})
        steps: list[ToolStep] = []
        resumed: ToolStep | None = None
        if parked is not None:
            self._tools.restore(parked)
            steps = [ToolStep(**step) for step in parked["steps"]]
            resumed = ToolStep(**parked["step"])
        for _ in range(self._settings.max_tool_steps + 1):
            step = resumed or await self._next_step(provider, messages, upstream_call, steps)
            resumed = None
            if step is None:
                return  # the attempt ended (or was handed to a retry) inside the step
            if self._tools.awaiting and not await self._await_approvals(upstream_call, steps, step):
                return  # parked: a decision queues the turn again; or it ended
            if self._tools.pending:  # the client runs these: the attempt ends with them
                await self._finish(TurnStatus.REQUIRES_ACTION, "tool_calls")
                return
            if not step.calls:
                break
            steps.append(step)
        else:
            await self._fail(
                "tool_steps_exhausted",
                "the model kept calling tools for BROKER_MAX_TOOL_STEPS="
                f"{self._settings.max_tool_steps} steps",
            )
            return
        problem = output_problem(self._request.get("response_format", "text"), self._text)
        if problem is not None:
            await self._fail("invalid_output", problem)
            return
        await self._finish(TurnStatus.COMPLETE, None)

    async def _await_approvals(
        self, upstream_call: int, steps: list[ToolStep], step: ToolStep
    ) -> bool:
        """Calls of ``step`` wait for a person: park the attempt (False: this worker lets go),
        or, when every one was decided already, run them now (True: go on). False too when the
        attempt ended here (a stop, or a call's outcome failed the turn)."""
        tools = self._tools
        record = {
            **self._record,
            "parked": {
                **tools.parked(),
                "steps": [dataclasses.asdict(done) for done in steps],
                "step": dataclasses.asdict(step),
                "usage": self._usage,
                "upstream_call": upstream_call,
            },
        }
        ids = [call["approval_id"] for call in tools.awaiting]
        answer = await self._writer.park(self._n, record, self._text, ids)
        if answer == "parked":
            log.info("turn %s attempt %d waits for approval", self._run.turn_id, self._n)
            return False
        if answer == "stop":
            await self._finish(TurnStatus.CANCELLED, "cancelled")
            return False
        try:
            await tools.resolve(step)
        except ToolFailure as failure:
            await self._finish(
                TurnStatus.FAILED, failure.reason, error={**failure.error, "retryable": False}
            )
            return False
        return True

    async def _next_step(
        self,
        provider: Provider,
        messages: list[dict[str, Any]],
        upstream_call: int,
        steps: list[ToolStep],
    ) -> ToolStep | None:
        """The model's next message (see :meth:`_stream_step`)."""
        client_tools: list[dict[str, Any]] = self._request.get("client_tools", [])
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
            client_tools=client_tools,
        )
        return await self._stream_step(provider, request)

    async def _stream_step(self, provider: Provider, request: GenerationRequest) -> ToolStep | None:
        """Stream one model message; its tool calls run as soon as their arguments are whole.

        Returns the step (text, calls, results) when the message ended, None when the attempt
        ended inside it. Raises _Retry for a retryable failure before any output.
        """
        stream = provider.stream(request)
        outcome = "ok"
        step_start = self._output.delta_count
        tool_calls = self._tools.message()
        try:
            await self._read_message(provider, stream, tool_calls)
        except UpstreamError as exc:
            await self._output.drain()  # what was read before the failure counts as delivered
            delivered = self._output.reached_readers
            await tool_calls.abandon(show=delivered)
            error = {"code": exc.code, "message": exc.message, "retryable": exc.retryable}
            timeout = exc.code == "upstream_timeout"
            if delivered:
                outcome = "interrupted"
                await self._interrupt("upstream_timeout" if timeout else "upstream_error", error)
                return None
            if exc.retryable:
                outcome = "retryable_error"
                self._output.drop_pending_usage()  # the failed call's usage is not this answer's
                self._usage = None
                reason = "upstream_timeout" if timeout else "upstream_error"
                raise _Retry(reason, error, exc.retry_after_s) from None
            outcome = "fatal_error"
            await self._finish(TurnStatus.FAILED, exc.code, error=error)
            return None
        except ToolFailure as failure:
            await self._finish(
                TurnStatus.FAILED, failure.reason, error={**failure.error, "retryable": False}
            )
            return None
        except StopRequested:  # the stop reached an append before it reached this task
            outcome = "cancelled"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled" if self._run.stop == STOP else "interrupted"
            raise
        finally:
            await stream.aclose()  # an abort reaches the upstream call at once
            self._metrics.upstream_requests.labels(provider.name, request.model, outcome).inc()
        return ToolStep(self._output.text_since(step_start), tool_calls.calls, tool_calls.results)

    async def _read_message(
        self,
        provider: Provider,
        stream: AsyncGenerator[ProviderEvent, None],
        tool_calls: ToolCalls,
    ) -> None:
        """Read one model message to its end, acting on each event as it arrives; raise
        ``UpstreamError`` when the upstream goes quiet or ends the message early."""
        began = time.monotonic()
        first_token = True
        finished = False
        idle = self._settings.upstream_idle_timeout_s
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
                await self._output.queue_delta(event.text)
            elif isinstance(event, ToolCallChunk):
                await tool_calls.add(event)
            elif isinstance(event, ToolCallEnd):
                await tool_calls.end(event.index)
            elif isinstance(event, Usage):
                await self._add_usage(event)
            elif isinstance(event, Finished):
                await tool_calls.end_all()  # the message's end completes its calls
                finished = True
                break
        await self._output.drain()
        if not finished:
            raise UpstreamError(
                "upstream_incomplete",
                "the upstream stream ended without its terminal event",
                retryable=True,
            )

    async def _add_usage(self, event: Usage) -> None:
        """Count a step's tokens for the attempt's record, and put them on the stream after the
        deltas they follow (or with the first output: see :meth:`AttemptOutput.usage`)."""
        so_far = self._usage or {"input_tokens": 0, "output_tokens": 0}
        self._usage = {
            "input_tokens": so_far["input_tokens"] + event.input_tokens,
            "output_tokens": so_far["output_tokens"] + event.output_tokens,
        }
        usage = {
            "attempt": self._n,
            "input_tokens": event.input_tokens,
            "output_tokens": event.output_tokens,
        }
        await self._output.usage(("usage", usage))

    async def _interrupt(self, reason: str, error: dict[str, Any] | None = None) -> None:
        code = error_code(error["code"] if error is not None else None)
        self._metrics.interruptions.labels(reason, code).inc()
        await self._finish(TurnStatus.INTERRUPTED, reason, error=error)

    async def _fail(self, code: str, message: str, *, upstream_code: str | None = None) -> None:
        """End the attempt failed for a reason that retrying would not change.

        ``upstream_code`` is the last upstream error's code when the retry limits ended it, so
        that a client tells a rate limit from an outage without parsing the message.
        """
        error: dict[str, Any] = {"code": code, "retryable": False, "message": message}
        if upstream_code is not None:
            error["upstream_code"] = upstream_code
        self._record = {**self._record, "error": message}  # why, for the state and the doors
        await self._finish(TurnStatus.FAILED, code, error=error)

    async def _finish(
        self, status: TurnStatus, reason: str | None, *, error: dict[str, Any] | None = None
    ) -> None:
        # The end comes after every delta; deltas a stop or a full stream refused stay out.
        with contextlib.suppress(StopRequested, StreamFull):
            await self._output.drain()
        before = self._output.take_before_end()
        if error is not None:
            before.append(("error", {"attempt": self._n, **error}))
        text = self._text
        requires_action = status == TurnStatus.REQUIRES_ACTION
        promote = status in PROMOTED_STATUSES and (bool(text) or requires_action)
        if self._usage is not None:
            self._record = {**self._record, "usage": self._usage}
        if requires_action:
            self._record = {**self._record, "tool_calls": self._tools.pending}
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
        key = self._deps.keys.events(self._run.conversation_id, self._run.turn_id)
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
                elif fields.get("e") in TOOL_EVENTS:
                    tool_output = True
            start = "(" + page[-1][0]
        return has_attempt_event, "".join(text), tool_output
