"""One pass of a process's heartbeat ticker over its feeds' parked readers (:mod:`broker.fanout`).

A reader with a sink gets its heartbeat written by the ticker itself and stays parked (no task
switch); the feed then looks at its turn once for all of them (at most once per heartbeat
period), and wakes them only if the turn came to rest. Any other reader (a long poll, a
dialect's, one whose write cannot be done at once) is woken, and its own heartbeat follows.

The feeds and readers are :mod:`broker.fanout`'s; this module knows them by what it uses of
them (:class:`Feed`, :class:`Parked`), and imports nothing of the fan-out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from operator import attrgetter
from typing import Protocol, TypeVar

from broker.sse import PING, Sink

log = logging.getLogger("broker.fanout")


class Parked(Protocol):
    """A reader parked on its feed, as the ticker sees it."""

    deadline: float  # when it gets a heartbeat
    timeout: float  # its heartbeat period
    ticked: bool  # woken by the ticker
    sink: Sink | None
    waiter: asyncio.Future[None] | None

    def wake(self) -> None: ...


P = TypeVar("P", bound=Parked)


class Feed(Protocol[P]):
    """A feed, as the ticker sees it: its parked readers, in deadline order or not."""

    parked: list[P]
    in_order: bool

    def park(self, subscription: P) -> None: ...

    def shared_look(self, now: float, max_age_s: float) -> asyncio.Future[bool]: ...


def beat(feeds: Iterable[Feed[P]], now: float, tick_s: float) -> None:
    """Heartbeats for the parked readers of ``feeds`` whose quiet time is up at ``now``, for a
    ticker that passes every ``tick_s``."""
    # Due by the middle of the next period counts as due now: a heartbeat is written up to half
    # a period early rather than up to a whole one (and the tick's own work) late, so the
    # silence stays within the period plus one tick.
    horizon = now + tick_s / 2
    for feed in list(feeds):
        parked = feed.parked
        if not parked:
            continue
        if feed.in_order:
            # In deadline order: the due readers are a prefix, found without a look at the
            # others (ten thousand quiet readers cost a look per feed per tick).
            due = 0
            while due < len(parked) and parked[due].deadline <= horizon:
                due += 1
            if not due:
                continue
            kept, looked_at = parked[due:], parked[:due]
        else:
            kept, looked_at = [], parked
        feed.parked, feed.in_order = kept, True
        period: float | None = None  # the shortest heartbeat period written to
        for subscription in looked_at:
            if subscription.deadline > horizon:
                feed.park(subscription)
            elif _write_heartbeat(subscription):
                subscription.deadline = now + subscription.timeout
                feed.park(subscription)
                timeout = subscription.timeout
                period = timeout if period is None else min(period, timeout)
            else:
                subscription.ticked = True
                subscription.wake()
        if not feed.in_order:
            feed.parked.sort(key=attrgetter("deadline"))
            feed.in_order = True
        if period is not None:
            feed.shared_look(now, period)


def _write_heartbeat(subscription: Parked) -> bool:
    """Whether a heartbeat was written to a parked reader's sink at once."""
    sink = subscription.sink
    if sink is None or subscription.waiter is None or subscription.waiter.done():
        return False
    try:
        return sink.write_now(PING)
    except Exception:  # one response's failure must not stop the others' heartbeats
        log.exception("writing a heartbeat failed")
        return False
