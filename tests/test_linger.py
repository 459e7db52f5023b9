"""When an append waits for more deltas, and when a feed rests after a hand-over: pure rules,
on a clock the tests move (no sleeps)."""

from __future__ import annotations

import pytest

from broker.fanout import PAUSE_MIN_S, pause_after
from broker.output import BURST_SHARE, Linger

CAP = 0.040  # BROKER_APPEND_LINGER_MS's default


def _paced(linger: Linger, gap_s: float, deltas: int, start: float = 0.0) -> float:
    """``deltas`` deltas ``gap_s`` apart from ``start``; returns the time of the last."""
    now = start
    for i in range(deltas):
        now = start + i * gap_s
        linger.delta(now)
    return now


@pytest.mark.parametrize(
    ("burst", "gap_s", "waits"),
    [
        (4, 0.010, True),  # BROKER_APPEND_BURST_DELTAS=4: 100 deltas/s is a burst
        (4, 0.015, False),  # 4 deltas take 45 ms: not within 40
        (8, 0.010, False),  # the default: 100 deltas/s goes a delta per append
        (2, 0.030, True),  # two within the linger are enough
    ],
)
def test_the_burst_is_as_many_deltas_as_set(burst: int, gap_s: float, waits: bool) -> None:
    linger = Linger(CAP, burst)
    now = _paced(linger, gap_s, 20)
    linger.appending(now)
    assert (linger.wait_s(now) > 0) is waits
    if waits:
        assert linger.wait_s(now) == pytest.approx((burst - 1) * gap_s)


def test_a_first_delta_goes_at_once() -> None:
    linger = Linger(CAP)
    linger.delta(10.0)
    assert linger.wait_s(10.0) == 0.0


@pytest.mark.parametrize(
    ("gap_s", "waits"),
    [
        (0.100, False),  # 10 deltas/s: each alone, at once
        (0.010, False),  # 100 deltas/s: 4 would share 40 ms, not a burst
        (0.006, False),  # 8 deltas take just over CAP
        (0.004, True),  # 250 deltas/s: a burst
        (0.001, True),  # 1,000 deltas/s
        (0.0, False),  # a network chunk of many at once: queued together, one append already
    ],
)
def test_only_a_burst_makes_an_append_wait(gap_s: float, waits: bool) -> None:
    linger = Linger(CAP)
    now = _paced(linger, gap_s, 40)
    linger.appending(now)
    assert (linger.wait_s(now) > 0) is waits
    if waits:
        # At most the cap, about BURST_SHARE gaps, from the last append's start.
        assert linger.wait_s(now) <= CAP
        assert linger.wait_s(now) == pytest.approx((BURST_SHARE - 1) * gap_s)


def test_a_burst_appends_a_window_apart_counted_from_the_last_append() -> None:
    linger = Linger(CAP)
    now = _paced(linger, 0.001, 40)
    linger.appending(now)
    window = linger.window_s
    assert 0 < window <= CAP
    assert linger.wait_s(now + window / 2) == pytest.approx(window / 2)
    assert linger.wait_s(now + window) == 0.0  # the window is over: at once


def test_a_few_deltas_bunched_by_a_late_wake_up_are_no_burst() -> None:
    # A model paced at 100 deltas/s whose process woke late: three deltas at once, then the
    # pace again. Its appends must not start waiting.
    linger = Linger(CAP)
    now = _paced(linger, 0.010, 20)
    for _ in range(3):
        linger.delta(now + 0.030)
    now = _paced(linger, 0.010, 5, start=now + 0.040)
    linger.appending(now)
    assert linger.window_s == 0.0
    assert linger.wait_s(now) == 0.0


def test_a_quiet_gap_ends_the_burst_and_its_first_delta_goes_at_once() -> None:
    linger = Linger(CAP)
    now = _paced(linger, 0.001, 40)
    linger.appending(now)
    assert linger.window_s > 0
    # A tool call, a slow stretch: a second of quiet, then the model speaks again.
    later = now + 1.0
    linger.delta(later)
    assert linger.window_s == 0.0
    assert linger.wait_s(later) == 0.0
    # ... and a new burst is found again within a few deltas.
    _paced(linger, 0.001, 8, start=later + 0.001)
    assert linger.window_s > 0


@pytest.mark.parametrize("cap", [0.0, -1.0])
def test_no_linger_never_waits(cap: float) -> None:
    linger = Linger(cap)
    now = _paced(linger, 0.0, 100)
    linger.appending(now)
    assert linger.window_s == 0.0
    assert linger.wait_s(now) == 0.0


@pytest.mark.parametrize(
    ("cpu_s", "wall_s", "cap_s", "pause_s"),
    [
        (0.0, 0.0, CAP, 0.0),  # nothing written
        (0.00002, 0.00002, CAP, 0.0),  # one reader: never a timer
        (PAUSE_MIN_S / 4 - 1e-6, 0.0002, CAP, 0.0),  # a few readers: not worth one
        (0.001, 0.001, CAP, 0.004),  # some tens of readers: a short rest
        (0.005, 0.005, CAP, 0.020),
        (0.010, 0.010, CAP, 0.030),  # many readers: reads the linger apart, the hand-over in
        (0.010, 0.025, CAP, 0.015),  # ... its wall time, preempted or not
        (0.002, 0.030, CAP, 0.008),  # a busy machine's delays are not the hand-over's cost
        (0.050, 0.050, CAP, 0.0),  # a hand-over longer than the linger: read again at once
        (0.020, 0.020, 0.0, 0.0),  # no linger: no rest
    ],
)
def test_a_feed_rests_in_proportion_to_its_last_handover(
    cpu_s: float, wall_s: float, cap_s: float, pause_s: float
) -> None:
    assert pause_after(cpu_s, wall_s, cap_s) == pytest.approx(pause_s)
