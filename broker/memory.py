"""Memory a burst freed, given back to the system.

Python frees a burst's objects (a thousand readers' responses, their buffers), but the C
allocator keeps the freed pages in its heap for the next burst, and the process's RSS stays at
its peak. glibc's ``malloc_trim`` returns the free pages at the heap's top and every whole free
page inside it. The broker calls it when many readers have left since its last look (see
``Runtime.trim_pools``): it walks the heap, a few milliseconds at most for a few hundred MiB,
so it is not called on every pass.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Final

log = logging.getLogger("broker.memory")

# Readers that must have left since the last look for memory to be given back.
GIVE_BACK_AFTER_READERS: Final = 200


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
    """Return the C heap's free pages to the system; False where that cannot be done."""
    if _TRIM is None:
        return False
    released = bool(_TRIM(0))
    log.debug("gave free heap pages back to the system: %s", released)
    return True
