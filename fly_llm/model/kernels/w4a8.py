"""4-bit weights × int8 activations: the layout, its quantization from float, and the native matmul.

A weight is w = d * q - m with q in 0..15 and a float16 scale d and minimum m per output column
and block of BLOCK input features (the shape of GGUF's Q4_K sub-blocks). Activations are
quantized per row and block to int8 with scale max|x| / 127 (llama.cpp's Q8 blocks). `linear`
runs `w4a8.cpp` (AVX-512 VNNI, else AVX2), `reference_linear` is the same math in float64 torch.
`project` is `linear` for a layer's forward, on a path that its caller looked up once (`isa_code`).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from fly_llm.model.kernels.build import load_extension

log = logging.getLogger(__name__)

BLOCK = 32  # input features per scale
COLUMNS = 16  # output columns per packed group
ISA_ENV = "FLY_W4A8_ISA"  # 'avx2' forces the AVX2 path (tests, benchmarks); unset or 'auto': the best
ISAS = {"auto": 0, "avx2": 1, "avx512_vnni": 2}
_X86 = {"x86_64", "amd64", "i686", "i386"}
_DTYPES = (torch.float32, torch.bfloat16)  # the kernel's input and output dtypes


@dataclass(frozen=True)
class QuantizedWeight:
    """A [n, k] weight as 4-bit levels `q` (uint8 [n, k]), scales `d` and minimums `m` (float16 [n, k/BLOCK])."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The weight these levels stand for, float32 [n, k]."""
        n, k = self.q.shape
        blocks = self.q.reshape(n, k // BLOCK, BLOCK).float()
        return (self.d.float()[..., None] * blocks - self.m.float()[..., None]).reshape(n, k)


@dataclass(frozen=True)
class PackedWeight:
    """A QuantizedWeight in the kernel's layout (w4a8.cpp): groups of COLUMNS outputs, blocks of BLOCK inputs."""

    q: torch.Tensor  # uint8 [groups, blocks, 4, 64]
    d: torch.Tensor  # float16 [groups, blocks, COLUMNS]
    m: torch.Tensor  # float16 [groups, blocks, COLUMNS]
    n: int  # output columns (the last group is padded with zero weights)

    def map(self, place: Callable[[torch.Tensor], torch.Tensor]) -> PackedWeight:
        """This weight with `place` applied to each of its tensors (e.g. to put them in other memory)."""
        return PackedWeight(place(self.q), place(self.d), place(self.m), self.n)


def concat(parts: list[PackedWeight]) -> PackedWeight:
    """Packed weights over the same input side by side: one weight whose outputs are the parts' in order
    (every part but the last a whole number of COLUMNS-wide groups)."""
    return PackedWeight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")),
                        n=sum(p.n for p in parts))


def check_width(k: int) -> None:
    """ValueError unless an input width `k` can be quantized (a positive multiple of BLOCK)."""
    if k <= 0 or k % BLOCK:
        raise ValueError(f"w4a8 needs an input width that is a multiple of {BLOCK}, not {k}")


def quantize_weight(weight: torch.Tensor) -> QuantizedWeight:
    """Round a float [n, k] weight to 4 bits per block of BLOCK inputs: d = (max - min) / 15, m = -min."""
    n, k = weight.shape
    check_width(k)
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    d, m = ((high - low) / 15).half(), (-low).half()
    step = torch.where(d > 0, d.float(), torch.ones_like(low))
    q = torch.round((blocks + m.float()[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(q.reshape(n, k), d, m)


def pack(weight: QuantizedWeight) -> PackedWeight:
    """The kernel's layout: byte 4*col + j of chunk c holds k = 8c + j (low nibble) and 8c + 4 + j (high)."""
    n, k = weight.q.shape
    pad = -n % COLUMNS
    groups, blocks = (n + pad) // COLUMNS, k // BLOCK
    q = F.pad(weight.q, (0, 0, 0, pad)).reshape(groups, COLUMNS, blocks, 4, 2, 4)  # [g, col, b, c, half, j]
    q = q.permute(0, 2, 3, 1, 5, 4)  # [g, b, c, col, j, half]
    q = (q[..., 0] | (q[..., 1] << 4)).reshape(groups, blocks, 4, 64).contiguous()

    def per_group(values: torch.Tensor) -> torch.Tensor:
        return F.pad(values, (0, 0, 0, pad)).reshape(groups, COLUMNS, blocks).transpose(1, 2).contiguous()

    return PackedWeight(q, per_group(weight.d), per_group(weight.m), n)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and block of BLOCK: int8 values in -127..127 and the float32 scale max|x| / 127."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale[..., None] > 0, torch.round(blocks / safe[..., None]), torch.zeros_like(blocks))
    return q.to(torch.int8).reshape(rows, k), scale


def reference_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's math in float64 torch: quantized activations times the dequantized weight (+ bias)."""
    q, scale = quantize_activations(x)
    rows, k = q.shape
    dequantized = (q.double().reshape(rows, k // BLOCK, BLOCK) * scale.double()[..., None]).reshape(rows, k)
    out = dequantized @ weight.dequantize().double().T
    return out if bias is None else out + bias.double()


@functools.cache
def _ops() -> ModuleType | None:
    """The compiled kernel, or None where it cannot run (not x86, no compiler, no AVX2)."""
    if platform.machine().lower() not in _X86:
        log.info("the w4a8 CPU kernel is x86 only (this is %s); using the fallback", platform.machine())
        return None
    ops = load_extension("w4a8")
    if ops is not None and ops.cpu_isa() == 0:
        log.warning("this CPU has neither AVX-512 VNNI nor AVX2 with FMA; the w4a8 kernel is not used")
        return None
    return ops


def available() -> bool:
    """Whether the kernel is built (compiling it on first call) and this CPU can run it."""
    return _ops() is not None


def best_isa() -> str:
    """The instruction set `linear` uses by default here: 'avx512_vnni' or 'avx2' ('none' if unavailable)."""
    ops = _ops()
    return {code: name for name, code in ISAS.items()}[ops.cpu_isa()] if ops is not None else "none"


@functools.cache
def _code(name: str) -> int:
    """The kernel's code for an instruction set's name (any case); ValueError for an unknown one."""
    if name.lower() not in ISAS:
        raise ValueError(f"unknown w4a8 instruction set {name!r}: choose one of {', '.join(ISAS)}")
    return ISAS[name.lower()]


def isa_code(isa: str | None = None) -> int:
    """The path `linear` takes for `isa` (default: $FLY_W4A8_ISA, else 'auto'), as the kernel's code.

    Reads the variable on every call (a changed variable is seen by the next call): a forward
    resolves it once (fly_llm.model.fused_layers: once a layer) and passes the code on.
    """
    return _code(isa or os.environ.get(ISA_ENV) or "auto")


def _native() -> ModuleType:
    """The compiled kernel; RuntimeError where it is not available."""
    ops = _ops()
    if ops is None:
        raise RuntimeError("the w4a8 kernel is not available here (see the log for why)")
    return ops


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
           isa: str | None = None) -> torch.Tensor:
    """x [..., k] times the packed weight's transpose (+ bias float32 [n]): [..., n] in x's dtype.

    x is float32 or bfloat16; a bfloat16 x gives exactly `linear(x.float()).bfloat16()`.
    `isa` ('auto', 'avx2', 'avx512_vnni'; default: $FLY_W4A8_ISA, else 'auto') picks the path;
    both give the same result bit for bit. Needs `available()`.
    """
    return project(x, weight, bias, isa_code(isa))


def project(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, code: int) -> torch.Tensor:
    """`linear` over the last dimension of x [..., k] on the path `code` from `isa_code`: [..., n] in
    x's dtype (a layer's forward: no look-up of the path per call). Other dtypes than float32 and
    bfloat16 are computed in float32."""
    if x.dtype not in _DTYPES:
        return project(x.float(), weight, bias, code).to(x.dtype)
    out = _native().linear(x.reshape(-1, x.shape[-1]).contiguous(), weight.q, weight.d, weight.m, bias, weight.n,
                           code)
    return out.view(*x.shape[:-1], weight.n)
