"""Appends that arrive together share one round trip (a group commit).

Appends to one stream that arrive while a call for it is in flight wait, in their order of
arrival, and go together in its next call (``ds_append`` takes a group: one Lua call, one reply
per append, in order), up to :data:`MAX_APPENDS` appends or :data:`MAX_BYTES` bytes a call. And
the calls of different streams that are ready in the same turn of the event loop (many writers,
each on its own stream, whose requests arrived together) go in one pipeline: one write to Redis
and one read of its replies, instead of one each (:meth:`StreamScripts.append_many`). A stream
has at most one call in flight, so its appends stay in order; an append to an idle stream waits
only for the end of the loop's turn, never for a timer.

Every append is still checked and answered on its own (the script runs each as if alone, after
the ones before it): an idempotent producer's sequence, ``Stream-Closed``, the quotas and the
conflicts; a refused append leaves the others of its group be. A call that fails (Redis is
unreachable) fails the appends it carried, each with that error, as it would have alone.

Calls are sent by a task of this process, not by a request's own task: an appender that is
cancelled (its client left) neither loses the others' appends nor relies on the cancellation
reaching through the Redis client (which may swallow it). One that leaves while its append
waits is taken out of the next group; once the group is sent, its append is made anyway (as a
call cut off after it was sent would be).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from broker.durable_store.keys import StreamKeys
from broker.durable_store.replies import AppendReply
from broker.durable_store.scripts import OneAppend

MAX_APPENDS: Final = 128  # the most appends of one call
MAX_BYTES: Final = 4 * 1024 * 1024  # and the most bytes of their bodies (the first goes anyway)

Group = tuple[StreamKeys, Sequence[OneAppend]]
# Groups of appends to different streams, a call each, sent together: each group's replies or
# the exception its call raised, in order.
CallMany = Callable[[Sequence[Group]], Awaitable[list[list[AppendReply] | Exception]]]
Waiting = tuple[OneAppend, "asyncio.Future[AppendReply]"]


class AppendGroups:
    """The appends waiting for each stream's next call (see the module's docstring)."""

    def __init__(self, call_many: CallMany) -> None:
        self._call_many = call_many
        # A stream with a call in flight or about to go -> the appends of its next call.
        self._waiting: dict[str, list[Waiting]] = {}
        self._ready: dict[str, StreamKeys] = {}  # streams whose next call goes at the turn's end
        self._flush_soon: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        """The streams with a call in flight or about to go."""
        return len(self._waiting)

    async def append(self, keys: StreamKeys, one: OneAppend) -> AppendReply:
        """``one``'s reply, from the call of the group it joins."""
        future: asyncio.Future[AppendReply] = asyncio.get_running_loop().create_future()
        waiting = self._waiting.get(keys.data)
        if waiting is None:  # an idle stream: its call goes at the end of this turn
            self._waiting[keys.data] = waiting = []
            self._make_ready(keys)
        waiting.append((one, future))
        return await future

    def _make_ready(self, keys: StreamKeys) -> None:
        self._ready[keys.data] = keys
        if self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send the next group of every ready stream, all in one round trip."""
        self._flush_soon = None
        batch: list[tuple[StreamKeys, list[Waiting]]] = []
        for data, keys in self._ready.items():
            # An appender that left before its group went out takes its append with it.
            waiting = [pending for pending in self._waiting[data] if not pending[1].done()]
            if not waiting:
                del self._waiting[data]
                continue
            group, self._waiting[data] = _cut(waiting)
            batch.append((keys, group))
        self._ready.clear()
        if batch:
            task = asyncio.create_task(self._send(batch), name="ds append groups")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[StreamKeys, list[Waiting]]]) -> None:
        try:
            groups = [(keys, [one for one, _ in group]) for keys, group in batch]
            try:
                results = await self._call_many(groups)
            except Exception as exc:
                results = [exc] * len(batch)
            except BaseException:  # cancelled (the loop closes): no reply will come
                for _, group in batch:
                    for _, future in group:
                        future.cancel()
                raise
            for (_, group), result in zip(batch, results, strict=True):
                _settle(group, result)
        finally:
            for keys, _ in batch:
                self._next(keys)

    def _next(self, keys: StreamKeys) -> None:
        """After a stream's call: its next group goes at the end of this turn, or it is idle."""
        if any(not future.done() for _, future in self._waiting[keys.data]):
            self._make_ready(keys)
        else:
            del self._waiting[keys.data]


def _settle(group: list[Waiting], result: list[AppendReply] | Exception) -> None:
    """Answer each append of ``group`` with its reply, or its call's exception."""
    for index, (_, future) in enumerate(group):
        if future.done():  # (its appender left: it was appended anyway)
            continue
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result[index])


def _cut(waiting: list[Waiting]) -> tuple[list[Waiting], list[Waiting]]:
    """The next group of ``waiting`` (in order, within the limits) and the rest."""
    size = 0
    for index, (one, _) in enumerate(waiting):
        size += len(one.body)
        if index and (index >= MAX_APPENDS or size > MAX_BYTES):
            return waiting[:index], waiting[index:]
    return waiting, []
