"""A decoder layer's small per-token ops as one native call each (`layer_ops.cpp`), with torch fallbacks.

RMSNorm (alone or after the residual add), rotary embedding of q and k (alone or with the KV cache
write: `rotary_store_`), and SiLU(gate) * up: the
non-matmul work of a Llama-family layer that transformers spreads over ~25 small aten calls
(fly_llm.model.fused_layers uses them). Each op takes float32 or bfloat16 on the CPU and computes
every row on its own in one fixed order, so a row's output is the same bit for bit whatever the
other rows, their number or the thread count. The native op follows transformers' arithmetic and
roundings; where it cannot (a sum's order, exp) it differs in float32's last bits, which a bf16
output almost always rounds away (tests/engine/test_layer_ops.py states the tolerances).
Elsewhere (another device or dtype, no compiler) each op is its `reference_*` twin in torch,
transformers' own arithmetic.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from fly_llm.model.kernels.build import load_extension

_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _ops() -> ModuleType | None:
    """The compiled ops, or None where they cannot be built (plain C++: any CPU with a compiler)."""
    return load_extension("layer_ops")


def available() -> bool:
    """Whether the ops are built (compiling them on first call)."""
    return _ops() is not None


def native(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the native ops compute a call on `x` (and `others` of its dtype): CPU, float32 or bfloat16."""
    dtype = x.dtype
    if not (x.is_cpu and dtype in _DTYPES and _ops() is not None):
        return False
    for other in others:  # a loop, not all(): this runs ~4 times a layer
        if other.dtype != dtype:
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of the last dimension: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)."""
    if not native(x, weight):
        return reference_rms_norm(x, weight, eps)
    return _ops().rms_norm(x.contiguous(), weight.contiguous(), eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm of it): a layer's residual add and the next norm in one call."""
    if not native(x, residual, weight):
        return reference_add_rms_norm(x, residual, weight, eps)
    return _ops().add_rms_norm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Rotate the first `heads` heads of `dim` values of each token of x [B, S, width] in place, as
    transformers' apply_rotary_pos_emb (rotate_half) does with cos and sin [B or 1, S, dim]; returns x."""
    cos, sin = cos.expand(x.shape[0], -1, -1), sin.expand(x.shape[0], -1, -1)
    if not (native(x, cos, sin) and x.is_contiguous()):
        return reference_rotary_(x, cos, sin, heads, dim)
    return _ops().rotary_(x, cos, sin, heads, dim)


def rotary_store_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, dim: int,
                  keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """`rotary_` on the query and key heads of a fused q/k/v output x [B, S, (heads + 2 kv_heads) * dim], then
    its key and value heads written into a cache's buffers keys/values [B, kv_heads, capacity, dim] at
    columns start .. start + S - 1 (a layer's rotary and cache write in one call); returns x."""
    cos, sin = cos.expand(x.shape[0], -1, -1), sin.expand(x.shape[0], -1, -1)
    if not (native(x, cos, sin, keys, values) and x.is_contiguous()):
        return reference_rotary_store_(x, cos, sin, heads, kv_heads, dim, keys, values, start)
    return _ops().rotary_store_(x, cos, sin, heads, kv_heads, dim, keys, values, start)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused [..., 2F] gate/up output (gate first): [..., F]."""
    if not native(gate_up):
        return reference_silu_mul(gate_up)
    return _ops().silu_mul(gate_up.contiguous())


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` in torch, transformers' Llama/Qwen2 RMSNorm step for step."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def reference_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` in torch."""
    total = residual + x
    return total, reference_rms_norm(total, weight, eps)


def reference_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """`rotary_` in torch: transformers' q * cos + rotate_half(q) * sin, written back into x."""
    rotated = x[..., :heads * dim].unflatten(-1, (heads, dim))
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    first, second = rotated.chunk(2, dim=-1)
    rotated.copy_(rotated * cos + torch.cat((-second, first), dim=-1) * sin)
    return x


def reference_rotary_store_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                            dim: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """`rotary_store_` in torch."""
    reference_rotary_(x, cos, sin, heads + kv_heads, dim)
    _, key, value = x.view(*x.shape[:2], -1, dim).transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
    keys[:, :, start:start + x.shape[1]], values[:, :, start:start + x.shape[1]] = key, value
    return x


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` in torch."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
