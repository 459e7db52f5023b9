"""A background step repeated at an interval (lease and lock renewals), stopped for sure.

A cancellation that lands while redis-py awaits a reply can be swallowed: the call returns
normally and the task goes on (redis/redis-py #2028, #2665). A renewal loop stopped by
``task.cancel()`` alone would then renew for ever, and whoever awaited its end would wait for
ever. :class:`Periodic` is stopped by a flag as well: after a swallowed cancellation the loop sees
the flag at its next pause, at once, and ends.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable


def next_due(due: float, interval_s: float, now: float) -> float:
    """The step after the one due at ``due``: one interval on, or, when that has passed too (a
    slow step, a blocked event loop), the first point of the same grid still ahead of ``now``.

    Steps keep their place on their own grid (the first step plus whole intervals) instead of
    counting each interval from the end of the last step: loops that a stall held up together
    (a thousand connections closed at once block the loop for a moment) go back to their own
    times afterwards, where counting from the step's end would line them all up for good, every
    step then taking a Redis connection at the same moment as the others. No step comes later
    than one interval after the step before it ended.
    """
    if interval_s <= 0:
        return now
    due += interval_s
    if due <= now:
        due += math.floor((now - due) / interval_s + 1) * interval_s
    return due


class Periodic:
    """Runs ``step`` every ``interval_s`` seconds until :meth:`stop`, or until ``step`` returns
    False. ``step`` handles its own errors: one that escapes ends the loop."""

    def __init__(
        self,
        step: Callable[[], Awaitable[bool]],
        interval_s: float,
        *,
        name: str,
        first_s: float | None = None,
    ) -> None:
        self._step = step
        self._interval_s = interval_s
        # The first pause (by default the interval): loops started together in a burst can
        # be spread over their interval, so that their steps do not all come at once.
        self._first_s = interval_s if first_s is None else first_s
        self._stopped = asyncio.Event()
        self.task = asyncio.create_task(self._loop(), name=name)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self._first_s
        while True:
            try:
                async with asyncio.timeout_at(due):
                    await self._stopped.wait()
                return
            except TimeoutError:
                pass
            if self._stopped.is_set() or not await self._step():
                return
            due = next_due(due, self._interval_s, loop.time())

    async def stop(self) -> None:
        """Stop the loop and wait for it to end; never raises what the loop raised."""
        self._stopped.set()
        self.task.cancel()
        await asyncio.wait([self.task])
