"""Appends to one stream that arrive together share one script call (a group commit).

An append to a stream with no call in flight is sent at once, alone. Those that arrive while a
call for the same stream is in flight wait, in their order of arrival, and go together in the
next call (``ds_append`` takes a group: one Lua call, one reply per append, in order), up to
:data:`MAX_APPENDS` appends or :data:`MAX_BYTES` bytes a call. So a stream with many writers
costs one round trip per group instead of one per append, and one writer alone pays nothing.

Every append is still checked and answered on its own (the script runs each as if alone, after
the ones before it): an idempotent producer's sequence, ``Stream-Closed``, the quotas and the
conflicts; a refused append leaves the others of its group be. A call that fails (Redis is
unreachable) fails the appends it carried, each with that error, as it would have alone.

The next group is sent by a task of this process, not by a request's own task: an appender that
is cancelled (its client left) neither loses the others' appends nor relies on the cancellation
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

Call = Callable[[StreamKeys, Sequence[OneAppend]], Awaitable[list[AppendReply]]]
Waiting = tuple[OneAppend, "asyncio.Future[AppendReply]"]


class AppendGroups:
    """The appends waiting for each stream's call in flight (see the module's docstring)."""

    def __init__(self, call: Call) -> None:
        self._call = call
        # A stream with a call in flight -> the appends that arrived since (its next group).
        self._waiting: dict[str, list[Waiting]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        """The streams with a call in flight."""
        return len(self._waiting)

    async def append(self, keys: StreamKeys, one: OneAppend) -> AppendReply:
        """``one``'s reply, from a call of its own or of the group it joins."""
        waiting = self._waiting.get(keys.data)
        if waiting is not None:  # a call is in flight: join the next one
            future: asyncio.Future[AppendReply] = asyncio.get_running_loop().create_future()
            waiting.append((one, future))
            return await future
        self._waiting[keys.data] = []
        try:
            (reply,) = await self._call(keys, [one])
        finally:
            self._next(keys)
        return reply

    def _next(self, keys: StreamKeys) -> None:
        """Send the appends that waited for the call that just ended, or mark the stream idle."""
        # An appender that left before its group went out takes its append with it.
        waiting = [pending for pending in self._waiting[keys.data] if not pending[1].done()]
        if not waiting:
            del self._waiting[keys.data]
            return
        group, rest = _cut(waiting)
        self._waiting[keys.data] = rest
        task = asyncio.create_task(self._send(keys, group), name="ds append group")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, keys: StreamKeys, group: list[Waiting]) -> None:
        try:
            replies = await self._call(keys, [one for one, _ in group])
        except Exception as exc:
            for _, future in group:
                if not future.done():
                    future.set_exception(exc)
        except BaseException:  # cancelled (the loop closes): no reply will come
            for _, future in group:
                future.cancel()
            raise
        else:
            for (_, future), reply in zip(group, replies, strict=True):
                if not future.done():  # (its appender may have left: it is appended anyway)
                    future.set_result(reply)
        finally:
            self._next(keys)


def _cut(waiting: list[Waiting]) -> tuple[list[Waiting], list[Waiting]]:
    """The next group of ``waiting`` (in order, within the limits) and the rest."""
    size = 0
    for index, (one, _) in enumerate(waiting):
        size += len(one.body)
        if index and (index >= MAX_APPENDS or size > MAX_BYTES):
            return waiting[:index], waiting[index:]
    return waiting, []
