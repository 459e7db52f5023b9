"""Memory a burst freed goes back to the system (``broker.memory.give_back``).

The heap test runs in a fresh process: 200 MiB of 4 KiB buffers (the C heap, not Python's
small-object arenas), then all freed but every 64th, so that the free pages sit inside the heap,
where freeing alone never returns them. RSS stays high until ``give_back``, then falls. The
others check the collection that runs first, and the start-up objects kept out of it
(``settle``)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from broker.memory import GIVE_BACK_AFTER_READERS, CrowdWatch, give_back, settle

SCRIPT = """
import sys
from broker.memory import give_back

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

base = rss_mib()
buffers = [bytearray(4096) for _ in range(50_000)]
keep = buffers[::64]
del buffers
freed = rss_mib()
assert give_back()
trimmed = rss_mib()
print(base, freed, trimmed)
"""


@pytest.mark.skipif(not give_back(), reason="not glibc: no malloc_trim")
def test_freed_heap_pages_go_back_to_the_system() -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    base, freed, trimmed = map(float, run.stdout.split())
    assert freed - base > 150, (base, freed, trimmed)  # freeing alone kept the pages
    assert trimmed - base < 30, (base, freed, trimmed)


def test_giving_back_frees_what_only_the_collector_frees() -> None:
    """A cycle (a closed Redis connection, a cancelled task and its traceback) outlives its
    last reference until a full collection: giving memory back runs one first."""

    class Node:
        peer: Node | None = None

    was_enabled = gc.isenabled()
    gc.disable()  # so that only give_back's own collection can free the cycle
    try:
        node = Node()
        node.peer = node
        ref = weakref.ref(node)
        del node
        assert ref() is not None
        give_back()
        assert ref() is None
    finally:
        if was_enabled:
            gc.enable()


def test_a_settled_process_keeps_what_it_holds_out_of_the_collectors_passes() -> None:
    frozen = gc.get_freeze_count()
    threshold = gc.get_threshold()
    try:
        settle()
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


FULL_PASSES = """
import collections, gc, sys
from broker.memory import settle

if sys.argv[1] == "settled":
    settle()
else:  # frozen as well, CPython's thresholds
    gc.collect()
    gc.freeze()
passes = collections.Counter()
gc.callbacks.append(lambda phase, info: phase == "stop" and passes.update([info["generation"]]))
held = [[n] for n in range(400_000)]  # a crowd's objects, kept while it lasts
print(passes[2])
"""


@pytest.mark.parametrize(("mode", "most"), [("settled", 0), ("frozen", None)])
def test_a_settled_process_walks_a_growing_crowd_s_objects_rarely(
    mode: str, most: int | None
) -> None:
    """A crowd of connections that opens keeps its objects: CPython's full passes walked them
    all, again and again, freeing nothing (a third of a connection storm's CPU)."""
    run = subprocess.run(
        [sys.executable, "-c", FULL_PASSES, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    full_passes = int(run.stdout)
    if most is None:
        assert full_passes >= 3  # what it was, and what settle spares
    else:
        assert full_passes <= most


@pytest.mark.parametrize(
    ("looks", "left_at"),
    [
        # A crowd of 250 comes and goes: gone once the count stops falling, and only once.
        ([0, 250, 250, 100, 0, 0, 0], [5]),
        # Still leaving at each look: not yet; then settled.
        ([300, 200, 90, 40, 40], [4]),
        # Fewer than GIVE_BACK_AFTER_READERS left: no crowd.
        ([0, 150, 0, 0], []),
        # Readers turning over without the count falling that far: nothing to give back.
        ([500, 450, 520, 400, 480, 400], []),
        # A second crowd counts from where the first left off.
        ([0, 300, 0, 0, 250, 0, 0], [3, 6]),
    ],
)
def test_a_crowd_counts_as_gone_once_its_readers_stop_leaving(
    looks: list[int], left_at: list[int]
) -> None:
    watch = CrowdWatch()
    assert [i for i, readers in enumerate(looks) if watch.left(readers)] == left_at
    assert GIVE_BACK_AFTER_READERS == 200  # (the table's sizes are chosen around it)
