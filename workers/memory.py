"""Keep a long-running worker's resident memory flat.

Batches of ever-changing shapes leave glibc's heaps full of freed-but-kept blocks: a worker's
RSS grows steadily without trimming and stays nearly flat with ``malloc_trim`` after every
window (docs/BENCHMARKS.md, memory). So the worker trims between windows, at
most every ``TRIM_INTERVAL_S``: on a CPU a window takes seconds and every window is trimmed as
before; on a GPU windows take milliseconds, and a trim per window (a walk over every heap,
holding the model thread) would cost more than the memory it returns.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # ctypes re-exports it at run time as ctypes._CFuncPtr; typeshed only under this name
    from _ctypes import CFuncPtr

TRIM_INTERVAL_S = 5.0


@functools.cache
def _libc_malloc_trim() -> CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # musl and other libcs have no malloc_trim
        return None


def release_free_memory() -> bool:
    """Give freed heap memory back to the OS; True when the C library supports it."""
    trim = _libc_malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class TrimTimer:
    """Says when the next trim is due: the first call, then every ``interval`` seconds."""

    def __init__(self, interval: float = TRIM_INTERVAL_S) -> None:
        self.interval = interval
        self._last: float | None = None

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last < self.interval:
            return False
        self._last = now
        return True
