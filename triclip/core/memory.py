"""glibc's malloc told to keep the memory a command frees, for the command to use again.

By default glibc gives back to the system any free stretch over 128 KB at the top of its heap, and serves a
block of 128 KB or more (a threshold that grows, as such blocks are freed, up to 32 MB) with its own mmap,
unmapped again when it is freed. A batch command allocates and frees buffers of the same sizes over and over
(decoded images, batches of tensors, a FAISS fit's tables), so the same memory is returned and faulted in
again page by page. On the 2-core VMs this project runs on, a fault costs ~7-13 us: the demo took 5.9M of
them, 52 s of system time in a 280 s run. Kept, ``triclip data prepare openclipart`` took 0.1M faults
instead of 1.05-1.11M, and 3.7-4.1 s less system time (docs/benchmarks.md, "Page faults"). The price: a
process's resident memory stays near its peak instead of shrinking after it (the demo's peak itself fell).
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top, bytes
MMAP_THRESHOLD = 32 << 20  # blocks this large and larger get their own mapping: glibc's largest (64-bit)


def keep_freed_memory() -> bool:
    """Set the two thresholds for this process and the ones it forks; False where the C library is not glibc."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):  # the C library's own answer, no file read
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):  # no such confstr name (not glibc), or no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
