"""glibc malloc settings for a fleet worker: large buffers reused from the heap, not mapped afresh.

By default glibc serves an allocation of 128 KiB or more with a fresh `mmap` and unmaps it again
on `free` (the threshold adapts, but to the size of the last such block freed, so a buffer that
was shrunk after use, as the token ids' int32 form is, keeps it low). The next buffer then
touches new pages: a page fault, and a page zeroed by the kernel, every 4 KiB. A fleet worker
handling long prompts allocates several such buffers a request (the client's body, the ids'
int32 form, the context answer). At 128k token ids the ids' read alone took ~130 faults a
request, about 0.5 ms on the development VM (`perf stat -e page-faults`; BENCHMARKS.md, "Large
buffers kept in the heap").

`keep_freed_heap()` serves every allocation up to `MMAP_THRESHOLD` (the public port's largest
body) from the heap, and keeps up to `TRIM_THRESHOLD` of freed memory at its top instead of
giving it back, so those pages stay mapped from one request to the next. The cost: a worker's
RSS stays near its high-water mark after a burst of long prompts. glibc only: elsewhere nothing
changes (`mallopt` missing).
"""

from __future__ import annotations

import ctypes
import logging

# mallopt's parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX on 64-bit); the public port's body limit too
TRIM_THRESHOLD = 64 << 20

log = logging.getLogger("shmdisagg.heap")


def keep_freed_heap() -> bool:
    """Set both thresholds for this process; False (and nothing changed) without glibc's
    `mallopt` or if it refused a value."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: large buffers stay mapped per allocation")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
