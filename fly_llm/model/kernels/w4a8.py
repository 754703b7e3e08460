"""4-bit weights × int8 activations: the layout, its quantization from float, and the native matmul.

A weight is w = d * q - m with q in 0..15 and a float16 scale d and minimum m per output column
and block of BLOCK input features (the shape of GGUF's Q4_K sub-blocks): `QuantizedWeight`. A GGUF's
published Q4_K weight stores d and m in two levels (`SuperBlockWeight`: a float16 per SUPER blocks
and an integer multiplier per block); packed, it keeps them (`TwoLevelScales`) beside d and m, and
the kernel streams whichever is cheaper for the number of rows (the same values: the same output
bit for bit). Activations are
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
SUPER = 8  # blocks per super-block of a two-level weight (GGUF's Q4_K: 256 weights)
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


def _rebuild(top: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """float16(top * sub) per block: `top` float16 per super-block and `sub` uint8 per block (last
    dimension; the float32 product is exact, then one rounding to float16, to nearest even)."""
    return (top.float().repeat_interleave(SUPER, dim=-1) * sub.float()).half()


@dataclass(frozen=True)
class SuperBlockWeight:
    """A [n, k] weight as GGUF's Q4_K holds it: levels `q` (uint8 [n, k]), float16 `d` and `m` per
    super-block of SUPER blocks ([n, k/(SUPER*BLOCK)]) and uint8 multipliers `sc`, `mn` per block
    ([n, k/BLOCK]): block j's scale is float16(d * sc[j]), its minimum float16(m * mn[j])."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor

    def per_block(self) -> QuantizedWeight:
        """The same weight with its float16 scale and minimum per block."""
        return QuantizedWeight(self.q, _rebuild(self.d, self.sc), _rebuild(self.m, self.mn))

    def dequantize(self) -> torch.Tensor:
        """The weight these levels stand for, float32 [n, k]."""
        return self.per_block().dequantize()


@dataclass(frozen=True)
class TwoLevelScales:
    """A packed weight's d and m as GGUF's Q4_K stores them: float16 `d`, `m` per super-block of SUPER
    blocks ([groups, blocks / SUPER, COLUMNS]) and uint8 multipliers `sc`, `mn` per block ([groups,
    blocks, COLUMNS]); block j's d is float16(d * sc[j]), its m float16(m * mn[j])."""

    d: torch.Tensor
    m: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor

    def map(self, place: Callable[[torch.Tensor], torch.Tensor]) -> TwoLevelScales:
        """These scales with `place` applied to each tensor."""
        return TwoLevelScales(place(self.d), place(self.m), place(self.sc), place(self.mn))


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the kernel's layout (w4a8.cpp): groups of COLUMNS outputs, blocks of BLOCK inputs.

    `levels` (a published Q4_K weight's): the same d and m in two levels, which the AVX-512 VNNI path
    streams instead of d and m over up to 4 rows (memory-bound: 4.625 bits a weight instead of 5);
    over more rows and on the AVX2 path (compute-bound) it reads d and m, saving the rebuild. Same
    output either way."""

    q: torch.Tensor  # uint8 [groups, blocks, 4, 64]
    d: torch.Tensor  # float16 [groups, blocks, COLUMNS]
    m: torch.Tensor  # float16 [groups, blocks, COLUMNS]
    n: int  # output columns (the last group is padded with zero weights)
    levels: TwoLevelScales | None = None

    def map(self, place: Callable[[torch.Tensor], torch.Tensor]) -> PackedWeight:
        """This weight with `place` applied to each of its tensors (e.g. to put them in other memory)."""
        return PackedWeight(place(self.q), place(self.d), place(self.m), self.n,
                            self.levels.map(place) if self.levels is not None else None)

    def one_level(self) -> PackedWeight:
        """The same weight without its two-level scales (the kernel then always reads d and m)."""
        return PackedWeight(self.q, self.d, self.m, self.n)


def concat(parts: list[PackedWeight]) -> PackedWeight:
    """Packed weights over the same input side by side: one weight whose outputs are the parts' in order
    (every part but the last a whole number of COLUMNS-wide groups); with two-level scales if every
    part has them."""
    q, d, m = (torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m"))
    levels = None
    if all(p.levels is not None for p in parts):
        levels = TwoLevelScales(*(torch.cat([getattr(p.levels, f) for p in parts]) for f in ("d", "m", "sc", "mn")))
    return PackedWeight(q, d, m, sum(p.n for p in parts), levels)


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


def pack(weight: QuantizedWeight | SuperBlockWeight) -> PackedWeight:
    """The kernel's layout: byte 4*col + j of chunk c holds k = 8c + j (low nibble) and 8c + 4 + j (high);
    a SuperBlockWeight keeps its two levels."""
    n, k = weight.q.shape
    pad = -n % COLUMNS
    groups, blocks = (n + pad) // COLUMNS, k // BLOCK
    q = F.pad(weight.q, (0, 0, 0, pad)).reshape(groups, COLUMNS, blocks, 4, 2, 4)  # [g, col, b, c, half, j]
    q = q.permute(0, 2, 3, 1, 5, 4)  # [g, b, c, col, j, half]
    q = (q[..., 0] | (q[..., 1] << 4)).reshape(groups, blocks, 4, 64).contiguous()

    def per_group(values: torch.Tensor) -> torch.Tensor:
        return F.pad(values, (0, 0, 0, pad)).reshape(groups, COLUMNS, -1).transpose(1, 2).contiguous()

    if isinstance(weight, SuperBlockWeight):
        levels = TwoLevelScales(*(per_group(getattr(weight, f)) for f in ("d", "m", "sc", "mn")))
        per_block = weight.per_block()
        return PackedWeight(q, per_group(per_block.d), per_group(per_block.m), n, levels)
    return PackedWeight(q, per_group(weight.d), per_group(weight.m), n)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and block of BLOCK: int8 values in -127..127 and the float32 scale max|x| / 127."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale[..., None] > 0, torch.round(blocks / safe[..., None]), torch.zeros_like(blocks))
    return q.to(torch.int8).reshape(rows, k), scale


def reference_linear(x: torch.Tensor, weight: QuantizedWeight | SuperBlockWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
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
    levels = weight.levels
    two = (levels.d, levels.m, levels.sc, levels.mn) if levels is not None else (None, None, None, None)
    out = _native().linear(x.reshape(-1, x.shape[-1]).contiguous(), weight.q, weight.d, weight.m, *two, bias,
                           weight.n, code)
    return out.view(*x.shape[:-1], weight.n)
