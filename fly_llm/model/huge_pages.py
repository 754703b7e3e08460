"""Weights that every decoding step streams, in 2 MiB pages (Linux transparent huge pages).

A 1-token step reads each packed weight once from memory; in 4 KiB pages that is ~235,000 pages a
target step, each a TLB entry to walk and a boundary where the CPU's prefetchers stop. Most Linux
systems run transparent huge pages in `madvise` mode (only memory that asks gets them), and torch's
allocator does not ask unless `THP_MEM_ALLOC_ENABLE` was set before it started. `in_huge_pages` copies
a tensor into fresh memory aligned to 2 MiB that asks (`madvise(MADV_HUGEPAGE)` before the first touch).
Measured on the embedded target's w4a8 Linear layers (benchmarks/results/kernel/huge-pages): a 1-token
pass 8-12% faster. Elsewhere (not Linux, THP off, a refusal) the tensor is returned as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@functools.cache
def _madvise():
    """libc's madvise, or None where transparent huge pages cannot be asked for."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        madvise = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def in_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a CPU tensor of at least one huge page) copied into memory that asks for 2 MiB pages:
    equal values, same shape and dtype, contiguous, its data 2 MiB-aligned. Anything else is returned
    unchanged, as is `tensor` where the pages cannot be asked for."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or tensor.nbytes < HUGE_PAGE:
        return tensor
    size = -(-tensor.nbytes // HUGE_PAGE) * HUGE_PAGE
    buffer = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)  # untouched: large allocations are fresh mappings
    start = -buffer.data_ptr() % HUGE_PAGE
    if madvise(buffer.data_ptr() + start, size, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
        return tensor
    copy = buffer[start:start + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy
