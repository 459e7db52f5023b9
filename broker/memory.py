"""Memory a burst freed, given back to the system.

Python frees a burst's objects (a thousand readers' responses, their buffers), but some of
them sit in reference cycles (a Redis connection a pool closed, a cancelled task and its
traceback) that only the garbage collector's full pass frees, and that pass runs when the
objects that survived earlier passes have grown by a quarter: in a quiet process, not for a
long time. And the C allocator keeps the freed pages in its heap for the next burst, so the
process's RSS stays at its peak. :func:`give_back` runs the full pass, then glibc's
``malloc_trim``, which returns the free pages at the heap's top and every whole free page
inside it. The broker calls it once a crowd of readers has left (:class:`CrowdWatch`, looked
at every second by ``Runtime.trim_pools``), not on every pass: it walks the objects and the
heap.

:func:`settle` moves everything a started broker holds for good (modules, classes, the app)
out of the collector's sight, so that its full passes, this one's and its own, walk only what
came since: a few milliseconds instead of tens. And it spaces the collector's own full passes
out (:data:`FULL_PASS_EVERY`): with nothing left in its oldest generation, CPython ran one
after every ten passes over the young objects, walking every live connection's objects each
time. A storm of 8,000 connections opening spent a third of its CPU in six of them (36 to 214
ms each, none freeing anything), and the longest pause was the attaches' p99.

What neither can return: CPython's small-object arenas (1 MiB each) go back only when every
object in them is gone, so one long-lived object allocated during a burst keeps its arena.
With ``PYTHONMALLOC=malloc`` every object comes from glibc instead, whose trim returns any whole
free page (see ``benchmarks/RESULTS.md`` for what each costs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import time
from typing import Final

log = logging.getLogger("broker.memory")

# Readers that must have left, from their peak, for a crowd to count as gone (CrowdWatch).
GIVE_BACK_AFTER_READERS: Final = 200
# The collector's passes over its middle generation between two full passes (CPython: 10). A
# full pass also waits, as CPython's own rule, until what survived to the oldest generation grew
# by a quarter; give_back runs one whenever a crowd has left.
FULL_PASS_EVERY: Final = 100


def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    """glibc's ``malloc_trim``, or None on another C library (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def give_back() -> bool:
    """Free what only the full collection frees, and return the C heap's free pages to the
    system; False where the pages cannot be returned (not glibc)."""
    began = time.perf_counter()
    collected = gc.collect()
    if _TRIM is None:
        return False
    released = bool(_TRIM(0))
    log.debug(
        "gave memory back: %d objects collected, free heap pages returned: %s, in %.1f ms",
        collected,
        released,
        (time.perf_counter() - began) * 1000,
    )
    return True


def settle() -> None:
    """Once a process has started: what it holds now is kept out of the collector's passes,
    and its full passes come every :data:`FULL_PASS_EVERY` passes over the middle generation."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_PASS_EVERY)


class CrowdWatch:
    """Whether a crowd of readers came and went, from the process's reader count looked at
    now and then: what it took (Redis connections, memory) can then be given back at once,
    rather than at the next trim periods."""

    __slots__ = ("_last", "_peak")

    def __init__(self, readers: int = 0) -> None:
        self._peak = self._last = readers

    @property
    def peak(self) -> int:
        """The most readers seen at once since the last crowd left."""
        return self._peak

    def left(self, readers: int) -> bool:
        """True, once, when ``GIVE_BACK_AFTER_READERS`` or more have left since the readers'
        peak and none left since the last look (the crowd is gone, not still leaving)."""
        settled = readers >= self._last
        self._last = readers
        self._peak = max(self._peak, readers)
        if settled and self._peak - readers >= GIVE_BACK_AFTER_READERS:
            self._peak = readers
            return True
        return False
