"""Freed memory kept for reuse by glibc's malloc after start-up, as tcmalloc would keep it.

A prefill step allocates tensors of megabytes (a 512-token prompt's MLP activations are 18 MB
on a 1.5B model) and frees them within the step. glibc serves such sizes with fresh mmap()s
and gives freed memory at the heap's top back to the kernel, so every step's tensors are new
pages: the kernel zeroes each on first touch, 8% of a Qwen2.5-Coder-1.5B prefill's time in a
profile (`clear_page_erms`, page faults) on the Xeon with AMX. vLLM's CPU docs have users
preload tcmalloc for the same reason. `keep_freed_memory()` first returns what loading left
free (malloc_trim), then has malloc serve sizes up to 256 MiB from its heap and keep up to
1 GiB of freed memory there: the steps' peak working set stays resident between steps instead
of being faulted in again (pp512 at one thread 1.13x, `BENCHMARKS.md` section 17; the price is
that the resident set keeps its peak). It does nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # malloc.h
MMAP_THRESHOLD = 256 << 20  # a 512-token step's fused gate/up output is 37 MB
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_done = False


def keep_freed_memory() -> bool:
    """Once per process; returns whether glibc took the settings."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        libc = None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD)))
    _done = ok
    return ok
