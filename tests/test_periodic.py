"""Periodic steps keep their own times through a stall.

A hundred lease heartbeats started at spread times must stay spread: counted from the end of
each step, a moment in which the event loop was blocked (ten thousand connections closing at
once) lined them all up for good, and every period they then took a Redis connection each at
the same moment.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from broker.periodic import Periodic, next_due


@pytest.mark.parametrize(
    ("due", "now", "expected"),
    [
        (10.0, 10.5, 12.0),  # on time: one interval on
        (10.0, 12.0, 14.0),  # the next point was just reached: the one after
        (10.0, 15.3, 16.0),  # late by more than two intervals: the grid's next point ahead
        (10.0, 11.9, 12.0),
    ],
)
def test_the_next_step_is_the_grids_next_point_ahead(
    due: float, now: float, expected: float
) -> None:
    assert next_due(due, 2.0, now) == pytest.approx(expected)


def test_no_step_comes_later_than_an_interval_after_the_last_ended() -> None:
    for now in (10.0, 11.0, 13.7, 99.9):
        assert now < next_due(10.0, 2.0, now) <= now + 2.0
    assert next_due(10.0, 0.0, 12.5) == 12.5  # no interval: at once


async def test_loops_held_up_together_go_back_to_their_own_times() -> None:
    interval = 0.4
    steps: dict[str, list[float]] = {"early": [], "late": []}
    stall_ended = float("inf")
    enough = asyncio.Event()  # three steps each since the stall

    def recorder(name: str) -> Periodic:
        async def step() -> bool:
            steps[name].append(time.monotonic())
            if all(sum(1 for t in ts if t > stall_ended) >= 3 for ts in steps.values()):
                enough.set()
            return True

        return Periodic(step, interval, name=name, first_s=0.1 if name == "early" else 0.3)

    loops = [recorder("early"), recorder("late")]
    try:
        await asyncio.sleep(0.05)
        # The event loop blocked (the fault this is about): both loops' steps fall due.
        time.sleep(1.0)  # noqa: ASYNC251
        stall_ended = time.monotonic()
        await asyncio.wait_for(enough.wait(), 5)
        after = {name: [t for t in ts if t > stall_ended] for name, ts in steps.items()}
        # Both ran at once when the stall ended; after that, each on its own time again, the
        # 0.2 s between them kept (counted from the stall's end, they would stay together).
        assert abs(after["early"][0] - after["late"][0]) < 0.1
        for k in (1, 2):
            gap = (after["late"][k] - after["early"][k]) % interval
            assert 0.1 < gap < 0.3, (k, after)
    finally:
        for loop in loops:
            await loop.stop()
