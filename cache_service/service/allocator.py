"""Freed memory kept for reuse by the service process (glibc's malloc only).

A store of a 28-47 MB prefix allocates its body, uvicorn's pieces of it and LMDB's dirty pages
afresh every time. By default glibc serves big allocations with their own mmap and returns
freed memory above 128 KiB-32 MiB to the kernel at once, so each store faulted in (and the
kernel zeroed) about twice its size in new pages: 23,000 minor faults and a third of the time
of a 16 x 2.95 MB store. Serving every allocation from the heap and keeping up to a bound of
freed memory at its top makes the next request reuse pages already mapped (about 450 faults).
The cost is resident memory: up to that bound stays with the process after a burst.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory(max_bytes: int) -> bool:
    """Serve allocations from the heap and keep up to `max_bytes` of it freed for reuse; True
    if applied (glibc), False where the allocator is another or `max_bytes` is 0."""
    if max_bytes <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  # glibc only: musl has mallopt as a stub
    except (OSError, AttributeError):
        log.info("freed memory is returned as the allocator decides (not glibc)")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    bound = min(max_bytes, 2**31 - 1)  # mallopt takes an int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, bound))
