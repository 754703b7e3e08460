"""How many bytes a piece of native work keeps allocated: what a compiled grammar costs (docs/design.md §1.5).

llguidance's objects report no size, and it allocates with the C allocator. On glibc, `mallinfo2()` gives
the bytes in use (arena blocks and mmapped blocks, all arenas); `kept_bytes(fn)` is its growth across
`fn()` while `fn`'s result is still held. It is exact in a process that does nothing else (the grammar
sandbox's worker) and an estimate in a busy one. Elsewhere (no glibc) it falls back to an estimate from
the grammar's length (`estimated_bytes`), fitted to llguidance 1.9's compiled sizes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

BASE_BYTES = 256 << 10
"""An estimate's fixed part: a small grammar compiles to ~150-550 KiB (its lexer and parser tables)."""
BYTES_PER_CHAR = 64
"""An estimate's part per grammar character: a 220 KB alternation compiles to ~10 MB (~45 bytes a character)."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def allocated_bytes() -> int | None:
    """Bytes the C allocator has handed out and not had back (glibc); None where it cannot tell."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def estimated_bytes(grammar: str) -> int:
    """What compiling `grammar` is expected to keep, from its length alone."""
    return BASE_BYTES + BYTES_PER_CHAR * len(grammar)


def kept_bytes(fn: Callable[[], T], grammar: str) -> tuple[T, int]:
    """`fn()` and the bytes it left allocated while its result is held (the estimate for `grammar` where the
    allocator cannot tell)."""
    before = allocated_bytes()
    result = fn()
    after = allocated_bytes()
    if before is None or after is None:
        return result, estimated_bytes(grammar)
    return result, max(0, after - before)
