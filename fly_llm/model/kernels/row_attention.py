"""Row attention in C++ (`row_attention.cpp`): each query over exactly the key columns it may see.

A query's output depends on that query, its allowed columns and their keys and values only, bit
for bit, so it is the same alone, in a verify, a prefill chunk or a batch (fly_llm/model/attention.py
uses it, with its pure-torch loop as the fallback). Float32 arithmetic for float32 and bfloat16
inputs; AVX-512 where the CPU has it and the head size is a multiple of 16, else AVX2.
"""

from __future__ import annotations

import functools
import logging
import platform
from types import ModuleType

import torch

from fly_llm.model.kernels.build import load_extension

log = logging.getLogger(__name__)

_X86 = {"x86_64", "amd64"}
PATHS = {2: "avx512", 1: "avx2", 0: "none"}


@functools.cache
def _ops() -> ModuleType | None:
    """The compiled op, or None where it cannot run (not x86-64, no compiler, no AVX2)."""
    if platform.machine().lower() not in _X86:
        return None
    ops = load_extension("row_attention")
    if ops is not None and ops.path(16) == 0:
        log.warning("this CPU has neither AVX-512 nor AVX2 with FMA; attention uses its torch fallback")
        return None
    return ops


def available() -> bool:
    """Whether the op is built (compiling it on first call) and this CPU can run it."""
    return _ops() is not None


def path(dim: int) -> str:
    """'avx512', 'avx2' or 'none': the path `attention` takes for head size `dim` here."""
    ops = _ops()
    return PATHS[ops.path(dim)] if ops is not None else "none"


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float, avx512: bool = True) -> torch.Tensor:
    """query [B, H, q, D], key/value [B, Hkv, kv, D] (float32 or bfloat16), mask bool [B, q, kv] (True: may
    attend; None: causal, query i sees columns up to kv - q + i) -> [B, q, H, D] in the inputs' dtype.
    `avx512=False` forces the AVX2 path. Needs `available()`."""
    ops = _ops()
    if ops is None:
        raise RuntimeError("the row attention op is not available here (see the log for why)")
    return ops.attention(query, key, value, mask, scale, avx512)
