"""4-bit weights × int8 activations: the layout, its quantization from float, and the native matmul.

A weight is w = d * q - m with q in 0..15 (or 0..31 with a fifth bit) and a scale d and minimum m per
output column and block of BLOCK input features (the shape of GGUF's Q4_K sub-blocks): `QuantizedWeight`,
float16 d and m where weights are rounded here (and GGUF's Q4_1 and Q5_1). A GGUF's published Q4_K and Q5_K weights
store d and m in two levels (`SuperBlockWeight`: a float16 per SUPER blocks and an integer multiplier per
block, d and m being their float32 products, as ggml computes them); packed, it keeps only those
(`TwoLevelScales`), and the kernel rebuilds each block's d and m from them on both paths and for any
number of rows. A fifth bit (Q5_K, Q5_1) is packed as a bit plane beside the nibbles. GGUF's other block
types are taken as published too (`SymmetricWeight`: Q8_0, Q6_K, Q5_0, Q4_0; w = d * sc * (q - zero) with
levels of 4 + `bits` bits), packed as `PackedSymmetric`:
the same nibbles plus bit planes for the high bits, the same bytes per weight as the file, or the levels as
whole bytes where rebuilding them from planes costs more than the extra bytes (`whole_bytes`).
Weights of different layouts over one input run side by side (`PackedParts`). Activations are
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
from dataclasses import dataclass, fields, replace
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


FIFTH_BITS = (0, 1)  # high bits a weight of scales and minimums may have above its nibbles


@dataclass(frozen=True)
class QuantizedWeight:
    """A [n, k] weight as levels `q` (uint8 [n, k], below 2^(4 + bits)), scales `d` and minimums `m`
    ([n, k/BLOCK]: float16 where rounded here or read from a Q4_1 or Q5_1, float32 where rebuilt from a published
    Q4_K's or Q5_K's two levels)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    bits: int = 0

    def dequantize(self) -> torch.Tensor:
        """The weight these levels stand for, float32 [n, k]."""
        n, k = self.q.shape
        blocks = self.q.reshape(n, k // BLOCK, BLOCK).float()
        return (self.d.float()[..., None] * blocks - self.m.float()[..., None]).reshape(n, k)


def _bytes(*tensors: torch.Tensor) -> int:
    """The bytes the tensors hold."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _rebuild(top: torch.Tensor, sub: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """top * sub per block in float32: `top` float16 per super-block and `sub` uint8 per block along `dim`
    (the product is exact: 11 x 8 bits; ggml's dequantization of Q4_K computes the same)."""
    return top.float().repeat_interleave(SUPER, dim=dim) * sub.float()


@dataclass(frozen=True)
class SuperBlockWeight:
    """A [n, k] weight as GGUF's Q4_K (`bits` 0) and Q5_K (`bits` 1) hold it: levels `q` (uint8 [n, k], below
    2^(4 + bits)), float16 `d` and `m` per super-block of SUPER blocks ([n, k/(SUPER*BLOCK)]) and uint8
    multipliers `sc`, `mn` per block ([n, k/BLOCK]): block j's scale is d * sc[j], its minimum m * mn[j], in
    float32 (exact)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    bits: int = 0

    def per_block(self) -> QuantizedWeight:
        """The same weight with its float32 scale and minimum per block."""
        return QuantizedWeight(self.q, _rebuild(self.d, self.sc), _rebuild(self.m, self.mn), self.bits)

    def dequantize(self) -> torch.Tensor:
        """The weight these levels stand for, float32 [n, k]."""
        return self.per_block().dequantize()


HALF = 16  # inputs per sub-scale of a SymmetricWeight (GGUF's Q6_K)
HIGH_BITS = (0, 1, 2, 4)  # the kernel's high bits above a level's nibble


@dataclass(frozen=True)
class SymmetricWeight:
    """A [n, k] weight w = d * sc * (q - zero), as GGUF's Q8_0, Q6_K, Q5_0 and Q4_0 hold it: unsigned
    levels `q` (uint8 [n, k], below 2^(4 + bits)), a float16 `d` per `span` blocks ([n, k/(span*BLOCK)])
    and an int8 `sc` per HALF inputs ([n, k/HALF]) or None (1)."""

    q: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor | None
    bits: int
    zero: int
    span: int = 1

    def dequantize(self) -> torch.Tensor:
        """The weight these levels stand for, float64 [n, k] (exact: at most 27 significant bits)."""
        w = self.d.double().repeat_interleave(self.span * BLOCK, dim=1) * (self.q.double() - self.zero)
        return w if self.sc is None else w * self.sc.double().repeat_interleave(HALF, dim=1)


def select_rows(weight: QuantizedWeight | SuperBlockWeight | SymmetricWeight,
                index: torch.Tensor) -> QuantizedWeight | SuperBlockWeight | SymmetricWeight:
    """The weight of the output rows `index` (int64) only: each of its tensors (all per row) indexed, nothing
    rounded."""
    return replace(weight, **{f.name: getattr(weight, f.name)[index] for f in fields(weight)
                              if isinstance(getattr(weight, f.name), torch.Tensor)})


@dataclass(frozen=True)
class TwoLevelScales:
    """A packed weight's d and m as GGUF's Q4_K stores them: float16 `d`, `m` per super-block of SUPER
    blocks ([groups, blocks / SUPER, COLUMNS]) and uint8 multipliers `sc`, `mn` per block ([groups,
    blocks, COLUMNS]); block j's d is d * sc[j], its m m * mn[j], in float32 (exact)."""

    d: torch.Tensor
    m: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor

    def map(self, place: Callable[[torch.Tensor], torch.Tensor]) -> TwoLevelScales:
        """These scales with `place` applied to each tensor."""
        return TwoLevelScales(place(self.d), place(self.m), place(self.sc), place(self.mn))

    def per_block(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each block's d and m, float32 [groups, blocks, COLUMNS]."""
        return _rebuild(self.d, self.sc, dim=1), _rebuild(self.m, self.mn, dim=1)


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the kernel's layout (w4a8.cpp): groups of COLUMNS outputs, blocks of BLOCK inputs.

    Its scales are either `d` and `m` per block (float16 where rounded here, float32 in `one_level`) or,
    for a published Q4_K or Q5_K weight, only its two `levels` (Q4_K: 4.625 bits a weight instead of 5 or 6),
    from which the kernel rebuilds d and m in float32 on both paths and for any number of rows. Levels of five
    bits keep their fifth bits in `planes` (one more bit a weight, as the file has it)."""

    q: torch.Tensor  # uint8 [groups, blocks, 4, 64]
    d: torch.Tensor | None  # float16 or float32 [groups, blocks, COLUMNS]; None with levels
    m: torch.Tensor | None
    n: int  # output columns (the last group is padded with zero weights)
    levels: TwoLevelScales | None = None
    planes: torch.Tensor | None = None  # the fifth bits: uint8 [groups, blocks, 4, 1, 2, 8] as PackedSymmetric's

    def __post_init__(self) -> None:
        if (self.levels is None) == (self.d is None or self.m is None):
            raise ValueError("a packed 4-bit weight has either d and m or two-level scales, not both")

    def map(self, place: Callable[[torch.Tensor], torch.Tensor]) -> PackedWeight:
        """This weight with `place` applied to each of its tensors (e.g. to put them in other memory)."""
        planes = None if self.planes is None else place(self.planes)
        if self.levels is not None:
            return PackedWeight(place(self.q), None, None, self.n, self.levels.map(place), planes)
        return PackedWeight(place(self.q), place(self.d), place(self.m), self.n, None, planes)

    def one_level(self) -> PackedWeight:
        """The same weight with d and m per block (float32 where rebuilt from two levels): the same output."""
        if self.levels is None:
            return self
        return PackedWeight(self.q, *self.levels.per_block(), self.n, None, self.planes)

    def streamed_bytes(self) -> int:
        """Bytes a forward streams: the levels, their fifth bits and the scales (two levels where kept)."""
        scales = (self.d, self.m) if self.levels is None else (self.levels.d, self.levels.m, self.levels.sc,
                                                                 self.levels.mn)
        return _bytes(self.q, *scales, *(() if self.planes is None else (self.planes,)))

    def weight_count(self) -> int:
        """Weights held, the padding of the last group included."""
        return self.q.numel() * 2

    def layout(self) -> tuple:
        """What two weights must share to be concatenated: the form of their scales and the fifth bits."""
        return ("4-bit", "two levels" if self.levels is not None else self.d.dtype, self.planes is not None)


@dataclass(frozen=True)
class PackedSymmetric:
    """A SymmetricWeight in the kernel's layout (w4a8.cpp, SymWeights): the low nibbles as PackedWeight's
    `q`, the high bits as planes of 64-bit masks, sc and d per group of COLUMNS outputs; or the levels as
    whole bytes in the nibbles' order, without planes (`whole_bytes`)."""

    lo: torch.Tensor  # uint8 [groups, blocks, 4, 64]; whole bytes: [groups, blocks, 4, 128]
    planes: torch.Tensor  # uint8 [groups, blocks, 4, bits, 2, 8]; whole bytes: [groups, blocks, 4, 0, 2, 8]
    sc: torch.Tensor | None  # int8 [groups, blocks, 2, COLUMNS]
    d: torch.Tensor  # float16 [groups, blocks / span, COLUMNS]
    n: int
    bits: int
    zero: int
    span: int

    def map(self, place: Callable[[torch.Tensor], torch.Tensor]) -> PackedSymmetric:
        """This weight with `place` applied to each of its tensors."""
        return PackedSymmetric(place(self.lo), place(self.planes), None if self.sc is None else place(self.sc),
                               place(self.d), self.n, self.bits, self.zero, self.span)

    def one_level(self) -> PackedSymmetric:
        """This weight (it has one layout only)."""
        return self

    def streamed_bytes(self) -> int:
        """Bytes a forward streams: the levels, their planes and the scales."""
        return _bytes(self.lo, self.planes, self.d, *(() if self.sc is None else (self.sc,)))

    def weight_count(self) -> int:
        """Weights held, the padding of the last group included."""
        groups, blocks = self.lo.shape[:2]
        return groups * blocks * COLUMNS * BLOCK

    @property
    def whole(self) -> bool:
        """Whether the levels are whole bytes (else nibbles and bit planes)."""
        return self.lo.shape[-1] == 2 * 64

    def layout(self) -> tuple[int, int, int, bool, bool]:
        """What two weights must share to be concatenated: bits, zero, span, whether sc is kept, whole bytes."""
        return self.bits, self.zero, self.span, self.sc is not None, self.whole


@dataclass(frozen=True)
class PackedParts:
    """Weights of different layouts over one input, their outputs side by side (a fused q/k/v whose v
    keeps another block type): each part runs on its own and the outputs are joined."""

    parts: tuple[PackedWeight | PackedSymmetric, ...]
    n: int

    def map(self, place: Callable[[torch.Tensor], torch.Tensor]) -> PackedParts:
        """These parts with `place` applied to each of their tensors."""
        return PackedParts(tuple(part.map(place) for part in self.parts), self.n)

    def one_level(self) -> PackedParts:
        """These parts without two-level scales."""
        return PackedParts(tuple(part.one_level() for part in self.parts), self.n)

    def streamed_bytes(self) -> int:
        """Bytes a forward streams, all parts together."""
        return sum(part.streamed_bytes() for part in self.parts)

    def weight_count(self) -> int:
        """Weights held, all parts together."""
        return sum(part.weight_count() for part in self.parts)


Packed = PackedWeight | PackedSymmetric | PackedParts


def _concat_like(parts: list[PackedWeight] | list[PackedSymmetric]) -> PackedWeight | PackedSymmetric:
    """Weights of one layout side by side as one weight of that layout."""
    if isinstance(parts[0], PackedSymmetric):
        first = parts[0]
        sc = torch.cat([p.sc for p in parts]) if first.sc is not None else None
        return PackedSymmetric(torch.cat([p.lo for p in parts]), torch.cat([p.planes for p in parts]), sc,
                               torch.cat([p.d for p in parts]), sum(p.n for p in parts), first.bits, first.zero,
                               first.span)
    q, n = torch.cat([p.q for p in parts]), sum(p.n for p in parts)
    planes = torch.cat([p.planes for p in parts]) if parts[0].planes is not None else None
    if parts[0].levels is not None:
        return PackedWeight(q, None, None, n, TwoLevelScales(
            *(torch.cat([getattr(p.levels, f) for p in parts]) for f in ("d", "m", "sc", "mn"))), planes)
    return PackedWeight(q, torch.cat([p.d for p in parts]), torch.cat([p.m for p in parts]), n, None, planes)


def concat(parts: list[Packed]) -> Packed:
    """Packed weights over the same input side by side: one weight whose outputs are the parts' in order
    (every part but the last a whole number of COLUMNS-wide groups). Neighbours of one layout are joined
    into one weight (4-bit ones whose scales have the same form); different layouts give PackedParts."""
    flat = [p for part in parts for p in (part.parts if isinstance(part, PackedParts) else (part,))]
    runs: list[list] = []
    for part in flat:
        if runs and runs[-1][-1].layout() == part.layout():
            runs[-1].append(part)
        else:
            runs.append([part])
    joined = [_concat_like(run) for run in runs]
    return joined[0] if len(joined) == 1 else PackedParts(tuple(joined), sum(p.n for p in joined))


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


def _nibble_layout(q: torch.Tensor, groups: int, pad: int) -> torch.Tensor:
    """[n, k] values as [groups, blocks, 4 chunks, 2 halves, 64]: chunk c's byte 4*col + j holds k = 8c + j
    (half 0, the low nibble) and 8c + 4 + j (half 1, the high nibble)."""
    k = q.shape[1]
    q = F.pad(q, (0, 0, 0, pad)).reshape(groups, COLUMNS, k // BLOCK, 4, 2, 4)  # [g, col, b, c, half, j]
    return q.permute(0, 2, 3, 4, 1, 5).reshape(groups, k // BLOCK, 4, 2, 64)


def _per_group(values: torch.Tensor, groups: int, pad: int) -> torch.Tensor:
    """[n, m] values per output as [groups, m, COLUMNS]."""
    return F.pad(values, (0, 0, 0, pad)).reshape(groups, COLUMNS, -1).transpose(1, 2).contiguous()


def _low_nibbles(values: torch.Tensor) -> torch.Tensor:
    """The levels' low nibbles of [groups, blocks, 4, 2, 64] values as the kernel's bytes [groups, blocks, 4, 64]
    (half 0 in the low nibble, half 1 in the high one)."""
    return ((values[..., 0, :] & 15) | ((values[..., 1, :] & 15) << 4)).contiguous()


def _planes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Bit p (p < bits) of the high parts (values >> 4) of [groups, blocks, 4, 2, 64] values as 64-bit
    masks, little-endian bytes: uint8 [groups, blocks, 4, bits, 2, 8] (bit i of a mask: byte i)."""
    high = values >> 4
    planes = [(high >> p) & 1 for p in range(bits)]
    stacked = torch.stack(planes, dim=3) if planes else high.new_zeros(*high.shape[:3], 0, *high.shape[3:])
    weights = (1 << torch.arange(8, dtype=torch.int32))
    return (stacked.reshape(*stacked.shape[:-1], 8, 8).int() * weights).sum(-1).to(torch.uint8).contiguous()


def pack(weight: QuantizedWeight | SuperBlockWeight) -> PackedWeight:
    """The kernel's layout: byte 4*col + j of chunk c holds k = 8c + j (low nibble) and 8c + 4 + j (high),
    a fifth bit goes to a bit plane (as `pack_symmetric`'s); a SuperBlockWeight keeps its two levels only."""
    n, k = weight.q.shape
    if weight.bits not in FIFTH_BITS:
        raise ValueError(f"a weight of scales and minimums has levels of 4 or 5 bits, not {4 + weight.bits}")
    if weight.q.numel() and int(weight.q.max()) >= 16 << weight.bits:
        raise ValueError(f"a level of {int(weight.q.max())} does not fit {4 + weight.bits} bits")
    pad = -n % COLUMNS
    groups = (n + pad) // COLUMNS
    values = _nibble_layout(weight.q, groups, pad)
    q, planes = _low_nibbles(values), _planes(values, weight.bits) if weight.bits else None
    if isinstance(weight, SuperBlockWeight):
        levels = TwoLevelScales(*(_per_group(getattr(weight, f), groups, pad) for f in ("d", "m", "sc", "mn")))
        return PackedWeight(q, None, None, n, levels, planes)
    return PackedWeight(q, _per_group(weight.d, groups, pad), _per_group(weight.m, groups, pad), n, None, planes)


def whole_bytes(bits: int) -> bool:
    """Whether `pack_symmetric` keeps levels of 4 + `bits` bits as whole bytes here: always for 8 bits (the
    same bytes as nibbles and four planes); for 6 bits (Q6_K) where the kernel's path is AVX2, whose tiles
    rebuild a level from its planes at 17 GB/s at one row against whole bytes' 27 GB/s, so that 30% more bytes
    still stream sooner (benchmarks/results/kernel/avx2-whole). VNNI adds planes with mask registers: nibbles."""
    return bits == 4 or (bits == 2 and best_isa() == "avx2")


def pack_symmetric(weight: SymmetricWeight, whole: bool | None = None) -> PackedSymmetric:
    """The kernel's layout of symmetric blocks: nibbles as `pack` lays them, bit p of the high part as a
    64-bit mask per chunk and nibble half (bit i: byte i), sc and d per group; or, `whole` (default:
    `whole_bytes(weight.bits)`; always for 8 bits), the levels as whole bytes in the same order, no planes."""
    n, k = weight.q.shape
    check_width(k)
    if weight.bits not in HIGH_BITS or k % (weight.span * BLOCK) or weight.span & (weight.span - 1):
        raise ValueError(f"symmetric blocks need bits in {HIGH_BITS} and whole spans of {weight.span} blocks "
                         "(a power of two)")
    pad = -n % COLUMNS
    groups = (n + pad) // COLUMNS
    values = _nibble_layout(weight.q, groups, pad)  # [g, b, c, half, 64]
    sc = None
    if weight.sc is not None:
        sc = _per_group(weight.sc, groups, pad).reshape(groups, k // BLOCK, 2, COLUMNS).contiguous()
    if whole if whole is not None else whole_bytes(weight.bits):
        if not (weight.zero <= 128 and (16 << weight.bits) - 1 - weight.zero <= 127):
            raise ValueError(f"whole-byte levels less the offset must be int8s, not with the offset {weight.zero} "
                             f"for {4 + weight.bits}-bit levels")
        lo, planes = values.reshape(groups, k // BLOCK, 4, 128).contiguous(), _planes(values, 0)
    elif weight.bits == 4:
        raise ValueError("8-bit levels are packed as whole bytes")
    else:
        lo, planes = _low_nibbles(values), _planes(values, weight.bits)
    return PackedSymmetric(lo, planes, sc, _per_group(weight.d, groups, pad), n, weight.bits, weight.zero,
                           weight.span)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and block of BLOCK: int8 values in -127..127 and the float32 scale max|x| / 127."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale[..., None] > 0, torch.round(blocks / safe[..., None]), torch.zeros_like(blocks))
    return q.to(torch.int8).reshape(rows, k), scale


def reference_linear(x: torch.Tensor, weight: QuantizedWeight | SuperBlockWeight | SymmetricWeight,
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


def linear(x: torch.Tensor, weight: Packed, bias: torch.Tensor | None = None,
           isa: str | None = None) -> torch.Tensor:
    """x [..., k] times the packed weight's transpose (+ bias float32 [n]): [..., n] in x's dtype.

    x is float32 or bfloat16; a bfloat16 x gives exactly `linear(x.float()).bfloat16()`.
    `isa` ('auto', 'avx2', 'avx512_vnni'; default: $FLY_W4A8_ISA, else 'auto') picks the path;
    both give the same result bit for bit. Needs `available()`.
    """
    return project(x, weight, bias, isa_code(isa))


def project(x: torch.Tensor, weight: Packed, bias: torch.Tensor | None, code: int) -> torch.Tensor:
    """`linear` over the last dimension of x [..., k] on the path `code` from `isa_code`: [..., n] in
    x's dtype (a layer's forward: no look-up of the path per call). Other dtypes than float32 and
    bfloat16 are computed in float32."""
    if x.dtype not in _DTYPES:
        return project(x.float(), weight, bias, code).to(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _rows(rows, weight, bias, code).view(*x.shape[:-1], weight.n)


def _rows(rows: torch.Tensor, weight: Packed, bias: torch.Tensor | None, code: int) -> torch.Tensor:
    """`project` of 2-D rows."""
    if isinstance(weight, PackedParts):
        outputs, start = [], 0
        for part in weight.parts:
            outputs.append(_rows(rows, part, None if bias is None else bias[start:start + part.n], code))
            start += part.n
        return torch.cat(outputs, dim=1)
    if isinstance(weight, PackedSymmetric):
        return _native().linear_sym(rows, weight.lo, weight.planes, weight.sc, weight.d, bias, weight.n,
                                    weight.bits, weight.zero, weight.span, code)
    levels = weight.levels
    two = (levels.d, levels.m, levels.sc, levels.mn) if levels is not None else (None, None, None, None)
    return _native().linear(rows, weight.q, weight.planes, weight.d, weight.m, *two, bias, weight.n, code)
