"""What one attempt puts on its turn's stream, in order, through its :class:`TurnWriter`.

Deltas are grouped: those that arrive while an append is in flight go together in the next one
(a group commit), so a fast model costs fewer round trips than it sends deltas. An append waits
for more only in a burst (:class:`Linger`: the last 8 deltas came within
``BROKER_APPEND_LINGER_MS``); then the appends of the burst go as far apart as those took, and
a delta after a quiet gap goes at once. What it costs to hand an append to many readers is the
fan-out's to save (:mod:`broker.fanout` rests a feed after a large hand-over), where the readers
are counted. The attempt's first output and everything that must follow the deltas (tool
events, usage, the end) never wait. Readers see the same events either way; each is in Redis
before any reader can see it, and the attempt's text only counts what was appended.

The order on the stream is kept here:

* every other event waits for the queued deltas, so the stream keeps the order they came in;
* the ``attempt`` event goes out with the attempt's first output, so that silent retries before
  it stay silent (a reader never sees an attempt that produced nothing);
* usage is held back until the first output for the same reason, and otherwise follows the
  deltas it counts;
* when the attempt ends, its flusher is emptied and cancelled (:meth:`AttemptOutput.close`), so
  that a flusher whose cancellation redis-py swallowed appends nothing more.
"""

from __future__ import annotations

import asyncio
import collections
import math
from typing import Any, Final

from broker.lease import Event, TurnWriter

# Deltas queued behind an append in flight before the model has to wait for Redis.
MAX_QUEUED_DELTAS = 512
# A burst: the last this many deltas came within the linger. Its appends then go as far apart
# as those deltas took, so about this many share each.
BURST_SHARE: Final = 8  # the default of BROKER_APPEND_BURST_DELTAS


class Linger:
    """When an attempt's next append goes: at once, unless the deltas come in a burst.

    It keeps the times of the last ``burst`` deltas (``BROKER_APPEND_BURST_DELTAS``,
    :data:`BURST_SHARE` by default). While they all came within
    ``cap_s``, the appends go as far apart as they took (so about that many share each),
    counted from the last append's start; otherwise (a paced model, a pause, the first deltas
    after one) an append goes as soon as the one in flight is done. A few deltas bunched by a
    late wake-up are no burst: it takes ``burst`` of them. Pure: the caller says what
    time it is.
    """

    __slots__ = ("_arrivals", "_last_append", "cap_s")

    def __init__(self, cap_s: float, burst: int = BURST_SHARE) -> None:
        self.cap_s = max(0.0, cap_s)
        self._arrivals: collections.deque[float] = collections.deque(maxlen=max(2, burst))
        self._last_append = -math.inf

    def delta(self, now: float) -> None:
        """A delta was queued at ``now``."""
        self._arrivals.append(now)

    def appending(self, now: float) -> None:
        """An append started at ``now``."""
        self._last_append = now

    @property
    def window_s(self) -> float:
        """How far apart the appends go: what the last ``burst`` deltas took, in a burst;
        else 0."""
        arrivals = self._arrivals
        if len(arrivals) < (arrivals.maxlen or BURST_SHARE):
            return 0.0
        span = max(0.0, arrivals[-1] - arrivals[0])
        return span if span <= self.cap_s and self.cap_s > 0 else 0.0

    def wait_s(self, now: float) -> float:
        """How long the next append waits, from ``now`` (0: it goes at once)."""
        return max(0.0, self._last_append + self.window_s - now)


class AttemptOutput:
    """The stream side of one attempt: its queued deltas, the text appended so far, and whether
    anything of it reached readers."""

    def __init__(
        self, writer: TurnWriter, attempt: int, *, linger_s: float = 0.0, burst: int = BURST_SHARE
    ) -> None:
        self._writer = writer
        self._n = attempt
        self._linger = Linger(linger_s, burst)
        self._hurry: asyncio.Future[None] | None = None  # ends the linger under way
        self._hurried = False  # someone waits for the queued deltas: no more lingering
        self.strategy: Any = None  # the attempt record's strategy, for its `attempt` event
        self.has_attempt_event = False
        self.tool_output = False  # tool events of this attempt are on the stream
        self._parts: list[str] = []  # the deltas appended, in order
        self._pending_usage: Event | None = None
        # Deltas waiting for their append, and the one task appending them.
        self._queued: list[Event] = []
        self._queued_text: list[str] = []
        self._flusher: asyncio.Task[None] | None = None
        self._flush_error: BaseException | None = None

    def resume(self, *, has_attempt_event: bool, text: str, tool_output: bool) -> None:
        """Start from what a lost worker's attempt already delivered (a takeover)."""
        self.has_attempt_event = has_attempt_event
        self._parts = [text] if text else []
        self.tool_output = tool_output

    @property
    def text(self) -> str:
        """The attempt's text appended so far."""
        return "".join(self._parts)

    @property
    def delta_count(self) -> int:
        """How many appended deltas make up :attr:`text` (a mark for :meth:`text_since`)."""
        return len(self._parts)

    def text_since(self, mark: int) -> str:
        """The text of the deltas appended after ``mark`` (a :attr:`delta_count`)."""
        return "".join(self._parts[mark:])

    @property
    def reached_readers(self) -> bool:
        """Whether anything of this attempt reached readers (text or tool events)."""
        return bool(self._parts) or self.tool_output

    @property
    def _flushing(self) -> bool:
        return self._flusher is not None and not self._flusher.done()

    async def queue_delta(self, text: str) -> None:
        """Append a delta soon, together with those that arrive while an append is in flight."""
        await self._queue(("delta", {"attempt": self._n, "text": text}), text)

    async def queue_event(self, event: Event) -> None:
        """Append a streamed event that holds no text (a piece of a tool call's arguments) as a
        delta is: soon, grouped with the deltas around it, in order."""
        await self._queue(event, "")

    async def _queue(self, event: Event, text: str) -> None:
        if self._flush_error is not None:
            await self.drain()  # raises it
        self._linger.delta(asyncio.get_running_loop().time())
        self._queued.append(event)
        self._queued_text.append(text)
        if not self._flushing:
            self._flusher = asyncio.create_task(self._flush(), name="append deltas")
        elif len(self._queued) >= MAX_QUEUED_DELTAS:
            await self.drain()  # Redis is slower than the model: wait for it

    async def _flush(self) -> None:
        try:
            while self._queued:
                await self._wait()
                events, texts = self._queued, self._queued_text
                self._queued, self._queued_text = [], []
                self._linger.appending(asyncio.get_running_loop().time())
                await self._write(events)
                self._parts.extend(texts)
        except Exception as exc:  # handed to the generation at its next step
            self._flush_error = exc
            self._queued, self._queued_text = [], []

    async def _wait(self) -> None:
        """In a burst, give the deltas that follow the time :class:`Linger` says to share the
        append; not the attempt's first output (its time to first token is the model's alone),
        nor once someone waits."""
        if not self.has_attempt_event or self._hurried:
            return
        loop = asyncio.get_running_loop()
        delay = self._linger.wait_s(loop.time())
        if delay <= 0:
            return
        hurry = self._hurry = loop.create_future()
        timer = loop.call_later(delay, _wake, hurry)
        try:
            await hurry  # a plain future: its cancellation does not pass through Redis
        finally:
            timer.cancel()
            self._hurry = None

    def _hurry_up(self) -> None:
        self._hurried = True
        if self._hurry is not None:
            _wake(self._hurry)

    async def drain(self) -> None:
        """Wait until every queued delta is appended; raise what stopped an append."""
        self._hurry_up()  # whoever waits for the deltas does not wait for the linger too
        flusher = self._flusher
        if flusher is not None and not flusher.done():
            # asyncio.wait: a cancelled caller must not cancel the append it waits for.
            await asyncio.wait([flusher])
        self._hurried = False
        error, self._flush_error = self._flush_error, None
        if error is not None:
            raise error

    async def append(self, events: list[Event]) -> None:
        """Append events after the queued deltas: the stream keeps its order."""
        await self.drain()
        await self._write(events)

    async def usage(self, usage: Event) -> None:
        """Append a usage event after the deltas it follows; held back while the attempt has
        no output, since a usage event alone would make it visible before a silent retry."""
        if self.reached_readers or self._queued or self._flushing:
            await self.append([usage])
        else:
            self._pending_usage = usage

    def drop_pending_usage(self) -> None:
        """Forget held-back usage: a failed call's usage is not the answer's."""
        self._pending_usage = None

    async def _write(self, events: list[Event]) -> None:
        if self._pending_usage is not None:
            events = [self._pending_usage, *events]
            self._pending_usage = None
        if not self.has_attempt_event:
            # The attempt becomes visible with its first output, so silent retries stay silent.
            events = [self.attempt_event(), *events]
        await self._writer.append(events)
        self.has_attempt_event = True
        if any(kind in ("tool_call", "tool_input_delta", "tool_result") for kind, _ in events):
            self.tool_output = True

    def attempt_event(self) -> Event:
        return ("attempt", {"attempt": self._n, "strategy": self.strategy})

    def take_before_end(self) -> list[Event]:
        """What must precede the attempt's ``end`` and has not been written: its ``attempt``
        event if it had no output, and held-back usage."""
        before: list[Event] = []
        if not self.has_attempt_event:
            before.append(self.attempt_event())
        if self._pending_usage is not None:
            before.append(self._pending_usage)
            self._pending_usage = None
        return before

    async def abandon_queued(self) -> None:
        """Stop appending (at a hand-back): what was not appended was never delivered."""
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
            await asyncio.wait([self._flusher])

    def close(self) -> None:
        """The attempt ended: a flusher still running is emptied and cancelled, so that one
        whose cancellation redis-py swallowed appends nothing more."""
        if self._flusher is not None and not self._flusher.done():
            self._queued, self._queued_text = [], []
            self._flusher.cancel()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
