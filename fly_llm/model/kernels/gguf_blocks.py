"""A GGUF's published Linear weights as the w4a8 kernel takes them, without a second rounding.

Every block type of a Q4_K_M or Q5_K_M file of a common model is read from the file's own bytes (the
formulas of llama.cpp's `dequantize_row_*`, gguf-py's `quants`):

- Q4_K: 256 weights in 144 bytes: float16 d and dmin, 12 bytes packing eight 6-bit scales and eight
  6-bit minimums, 128 bytes of 4-bit levels; sub-block s (32 weights) is w = d*sc[s]*q - dmin*mn[s].
  Decoded to a SuperBlockWeight; the kernel computes with d' = d*sc[s] and m' = dmin*mn[s] in float32, as
  llama.cpp does: exact (11 x 6 bits), so every value is the file's.
- Q5_K: Q4_K with a fifth bit per weight (176 bytes: 32 bytes of high bits between the scales and the
  nibbles; weight 32s + l's is bit s of byte l): a SuperBlockWeight of 5-bit levels.
- Q4_1 and Q5_1: 32 weights, float16 d and m, 16 bytes of nibbles (Q5_1: and 32 high bits as Q5_0's);
  w = d*q + m: a QuantizedWeight with minimum -m (exact).
- Q6_K: 256 weights in 210 bytes: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales
  (one per 16 weights) and a float16 d; w = d*sc*(q - 32), q in 0..63.
- Q8_0: 32 weights in 34 bytes: float16 d and 32 int8 levels; w = d*q (taken as q + 128 - 128).
- Q5_0: 32 weights in 22 bytes: float16 d, 32 high bits, 16 bytes of nibbles; w = d*(q - 16).
- Q4_0: 32 weights in 18 bytes: float16 d, 16 bytes of nibbles; w = d*(q - 8).

The last four decode to a SymmetricWeight whose values are exactly the file's too (d*sc*(q - zero) has at
most 19 significant bits: exact in float32).

`published_blocks` picks the tensors of those types that are weights of a model's Linear layers,
named as the model names them and with rows in the model's order (transformers' own GGUF name map
and tensor processor, so e.g. a Llama's q/k row permutation is undone as for the float weights).
They are stored raw with their types (`save_published`) and decoded one Linear at a time on load
(`PublishedWeights`).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map,
                                                      read_field)

from fly_llm.model.kernels.w4a8 import HALF, SUPER, QuantizedWeight, SuperBlockWeight, SymmetricWeight

log = logging.getLogger(__name__)

FORMAT = "gguf-blocks"  # the safetensors metadata tag of a file `save_published` wrote
Published = QuantizedWeight | SuperBlockWeight | SymmetricWeight


def _split(blocks: torch.Tensor, size: int, name: str) -> torch.Tensor:
    """Raw rows (uint8 [n, blocks*size]) as [n, blocks, size]; ValueError for anything else."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise ValueError(f"{name} rows are uint8 [n, multiple of {size}], not {blocks.dtype} {list(blocks.shape)}")
    return blocks.reshape(blocks.shape[0], -1, size)


def _half(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes per entry as float16: [n, blocks, 2] -> [n, blocks]."""
    return raw.contiguous().view(torch.float16).reshape(raw.shape[:2])


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """16 bytes per block as 32 levels: weight j in the low nibble of byte j, j + 16 in the high one."""
    return torch.cat([raw & 15, raw >> 4], dim=-1)


def _fifth_bits(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes [n, blocks, b] as their 8b bits [n, blocks, 8b] (bit j: byte j // 8, bit j % 8)."""
    bits = (raw.to(torch.int64)[..., None] >> torch.arange(8)) & 1
    return bits.reshape(*raw.shape[:2], -1).to(torch.uint8)


def _super_block(raw: torch.Tensor, high: torch.Tensor | None) -> SuperBlockWeight:
    """Q4_K's or Q5_K's blocks [n, supers, bytes] (d, dmin, 12 bytes of 6-bit multipliers, then the nibbles
    in the last 128 bytes) with the fifth bits `high` ([n, supers, 32] bytes: bit s of byte l is weight
    32s + l's) or none."""
    n, supers = raw.shape[:2]
    packed = raw[..., 4:16].to(torch.int32)
    low, top, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low & 63, (extra & 15) | ((low >> 2) & 48)], dim=-1)  # [n, supers, 8]
    minimums = torch.cat([top & 63, (extra >> 4) | ((top >> 2) & 48)], dim=-1)
    nibbles = raw[..., -128:].reshape(n, supers, 4, 1, 32)  # 32 bytes: sub-blocks 2j (low) and 2j + 1 (high)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=3).reshape(n, supers, SUPER, 32)
    if high is not None:
        q = q | (((high[..., None, :] >> torch.arange(SUPER, dtype=torch.uint8)[:, None]) & 1) << 4)
    return SuperBlockWeight(q.reshape(n, supers * 256).contiguous(), _half(raw[..., 0:2]), _half(raw[..., 2:4]),
                            scales.to(torch.uint8).reshape(n, supers * SUPER),
                            minimums.to(torch.uint8).reshape(n, supers * SUPER), bits=int(high is not None))


def decode_q4_k(blocks: torch.Tensor) -> SuperBlockWeight:
    """Raw Q4_K rows as levels q (uint8 [n, k]), float16 d and dmin per 256 weights and their 6-bit
    multipliers per 32 (uint8)."""
    return _super_block(_split(blocks, 144, "Q4_K"), None)


def decode_q5_k(blocks: torch.Tensor) -> SuperBlockWeight:
    """Raw Q5_K rows: Q4_K's with the fifth bits in the 32 bytes after the multipliers."""
    raw = _split(blocks, 176, "Q5_K")
    return _super_block(raw, raw[..., 16:48])


def decode_q6_k(blocks: torch.Tensor) -> SymmetricWeight:
    """Raw Q6_K rows: per 128 weights, weight 32g + l (g 0..3, l 0..31) has the low (g < 2) or high
    (g >= 2) nibble of ql[l + 32 (g % 2)] and bits 2g, 2g + 1 of qh[l]."""
    raw = _split(blocks, 210, "Q6_K")
    n, supers = raw.shape[:2]
    ql = raw[..., :128].reshape(n, supers, 2, 2, 32)  # [.., half of 256, g % 2, l]
    qh = raw[..., 128:192].reshape(n, supers, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=3)  # [.., half, g, l]
    high = torch.cat([(qh >> (2 * g)) & 3 for g in range(4)], dim=3)
    q = (low | (high << 4)).reshape(n, supers * 256)
    sc = raw[..., 192:208].contiguous().view(torch.int8).reshape(n, supers * 256 // HALF)
    return SymmetricWeight(q.contiguous(), _half(raw[..., 208:210]), sc.contiguous(), bits=2, zero=32, span=SUPER)


def decode_q8_0(blocks: torch.Tensor) -> SymmetricWeight:
    """Raw Q8_0 rows: int8 levels taken as q + 128 in 0..255 with zero 128."""
    raw = _split(blocks, 34, "Q8_0")
    q = (raw[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return SymmetricWeight(q.reshape(raw.shape[0], -1), _half(raw[..., 0:2]), None, bits=4, zero=128)


def decode_q5_0(blocks: torch.Tensor) -> SymmetricWeight:
    """Raw Q5_0 rows: weight j's fifth bit is bit j of the little-endian 32 bits after d."""
    raw = _split(blocks, 22, "Q5_0")
    q = _nibbles(raw[..., 6:]) | (_fifth_bits(raw[..., 2:6]) << 4)
    return SymmetricWeight(q.reshape(raw.shape[0], -1), _half(raw[..., 0:2]), None, bits=1, zero=16)


def decode_q4_0(blocks: torch.Tensor) -> SymmetricWeight:
    """Raw Q4_0 rows: nibbles with zero 8."""
    raw = _split(blocks, 18, "Q4_0")
    return SymmetricWeight(_nibbles(raw[..., 2:]).reshape(raw.shape[0], -1), _half(raw[..., 0:2]), None, bits=0,
                           zero=8)


def _with_minimum(raw: torch.Tensor, q: torch.Tensor, bits: int) -> QuantizedWeight:
    """Blocks of 32 that start with float16 d and m, levels q: w = d*q + m as d*q - (-m) (-m exact)."""
    return QuantizedWeight(q.reshape(raw.shape[0], -1), _half(raw[..., 0:2]), -_half(raw[..., 2:4]), bits)


def decode_q4_1(blocks: torch.Tensor) -> QuantizedWeight:
    """Raw Q4_1 rows: float16 d and m, then nibbles."""
    raw = _split(blocks, 20, "Q4_1")
    return _with_minimum(raw, _nibbles(raw[..., 4:]), bits=0)


def decode_q5_1(blocks: torch.Tensor) -> QuantizedWeight:
    """Raw Q5_1 rows: float16 d and m, 32 fifth bits (as Q5_0's), then nibbles."""
    raw = _split(blocks, 24, "Q5_1")
    return _with_minimum(raw, _nibbles(raw[..., 8:]) | (_fifth_bits(raw[..., 4:8]) << 4), bits=1)


_T = GGMLQuantizationType
DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], Published]] = {
    _T.Q4_K: decode_q4_k, _T.Q5_K: decode_q5_k, _T.Q6_K: decode_q6_k, _T.Q8_0: decode_q8_0, _T.Q5_0: decode_q5_0,
    _T.Q4_0: decode_q4_0, _T.Q4_1: decode_q4_1, _T.Q5_1: decode_q5_1}
"""The block types taken as published, each with its decoder (raw uint8 rows -> the kernel's weight)."""


def decode(kind: GGMLQuantizationType, blocks: torch.Tensor) -> Published:
    """Raw rows of one of the DECODERS' block types as the kernel's weight."""
    return DECODERS[kind](blocks)


def _row_order(processor: TensorProcessor, name: str, rows: int,
               names: dict[str, str]) -> tuple[str | None, np.ndarray] | None:
    """(model tensor name, source row per model row) as transformers' processor maps `name`; None if it
    does more than reorder rows (then the tensor is not taken as published)."""
    index = np.arange(rows).reshape(rows, 1)
    try:
        result = processor.process(weights=index, name=name, tensor_key_mapping=names,
                                   parsed_parameters={"tensors": {}, "config": {}})
    except Exception as exc:  # a processor that cannot take a row index: not a plain reordering
        log.info("GGUF tensor %s: not repacked (%s)", name, exc)
        return None
    order = np.asarray(result.weights)
    if order.shape != (rows, 1) or not np.array_equal(np.sort(order[:, 0]), index[:, 0]):
        return None
    return names.get(result.name), order[:, 0]


def published_blocks(gguf: Path, model: nn.Module) -> dict[str, tuple[GGMLQuantizationType, torch.Tensor]]:
    """The GGUF's tensors of the DECODERS' types that are weights of `model`'s Linear layers (a meta-device
    skeleton will do): (block type, raw rows) by Linear name, rows in the model's order."""
    reader = GGUFReader(gguf)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    linears = {f"{name}.weight": module for name, module in model.named_modules() if type(module) is nn.Linear}
    found = {}
    rounded: Counter[str] = Counter()  # Linear weights of block types no decoder reads
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if GGML_QUANT_SIZES[kind][0] == 1 or tensor.data.ndim != 2:  # plain numbers (F32, F16, ...): no blocks
            continue
        rows = tensor.data.shape[0]
        mapped = _row_order(processor, tensor.name, rows, names)
        linear = linears.get(mapped[0]) if mapped else None
        if linear is None or tuple(linear.weight.shape) != (rows, int(tensor.n_elements) // rows):
            continue
        if kind not in DECODERS:
            rounded[kind.name] += 1
            continue
        found[mapped[0].removesuffix(".weight")] = (
            kind, torch.from_numpy(np.ascontiguousarray(tensor.data[mapped[1]])))
    if rounded:
        log.warning("%s: %s Linear weights are of block types the w4a8 kernel does not read as published (%s); "
                    "under w4a8 they are rounded to 4 bits from their dequantized values", gguf.name,
                    sum(rounded.values()), ", ".join(f"{count} {kind}" for kind, count in sorted(rounded.items())))
    return found


def _decoded() -> str:
    """The block types this version takes as published, as a file records them."""
    return ",".join(sorted(kind.name for kind in DECODERS))


def save_published(blocks: Mapping[str, tuple[GGMLQuantizationType, torch.Tensor]], path: Path) -> None:
    """Write raw rows by Linear name, with their block types, to a safetensors file (possibly with none);
    it records which block types were looked for."""
    types = {name: kind.name for name, (kind, _) in blocks.items()}
    save_file({name: rows for name, (_, rows) in blocks.items()}, str(path),
              metadata={"format": FORMAT, "types": json.dumps(types), "decoded": _decoded()})


def is_current(path: Path) -> bool:
    """Whether `path` is a file `save_published` wrote in this format, looking for the block types this
    version reads (a file from a version that read fewer misses tensors of the others: it is written anew)."""
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
    except Exception:  # unreadable or not safetensors: not current
        return False
    return metadata.get("format") == FORMAT and metadata.get("decoded") == _decoded()


class PublishedWeights(Mapping[str, Published]):
    """The Linear weights of a `save_published` file, each decoded when asked for (for `quantize(published=)`)."""

    def __init__(self, path: Path) -> None:
        self._file = safe_open(str(path), framework="pt")
        metadata = self._file.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not a file of published GGUF blocks")
        self._types = {name: GGMLQuantizationType[kind] for name, kind in json.loads(metadata["types"]).items()}

    def kind(self, name: str) -> GGMLQuantizationType:
        """The block type of the weight `name`."""
        return self._types[name]

    def __getitem__(self, name: str) -> Published:
        if name not in self._types:
            raise KeyError(name)
        return decode(self._types[name], self._file.get_tensor(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._types)

    def __len__(self) -> int:
        return len(self._types)
