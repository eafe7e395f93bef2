"""Keep big freed buffers for reuse instead of returning them to the kernel.

ZeroMQ allocates a fresh buffer for every message it receives. With glibc's defaults, a buffer
of 128 KiB or more is a new ``mmap``: thousands of page faults and a kernel pass zeroing the
pages, on every push and pull of a big array. Raising the mmap threshold (to glibc's maximum,
32 MiB) and the trim threshold lets those buffers come from, and go back to, the heap.
Servers and workers call :func:`tune_allocator` at start; it does nothing off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_allocator() -> bool:
    """Returns whether the allocator took the settings."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    ok &= mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    ok &= mallopt(_M_TOP_PAD, 64 << 20)
    return bool(ok)


def trim() -> bool:
    """Give the heap's free pages back to the kernel (glibc's ``malloc_trim``): a server whose
    row-sparse tables grew leaves the superseded index arrays free in the heap, which the
    settings above would otherwise keep resident. A few ms; returns whether it ran."""
    name = ctypes.util.find_library("c")
    try:
        return bool(ctypes.CDLL(name or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
