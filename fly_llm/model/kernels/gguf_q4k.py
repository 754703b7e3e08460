"""A GGUF's published Q4_K weights as the w4a8 kernel's SuperBlockWeight, without a second rounding.

A Q4_K super-block holds 256 weights in 144 bytes: float16 d and dmin, 12 bytes packing eight 6-bit
scales and eight 6-bit minimums, and 128 bytes of 4-bit levels. Its sub-block s (32 weights)
stands for w = d*sc[s]*q - dmin*mn[s] (llama.cpp's `dequantize_row_q4_K`, gguf-py's `quants.Q4_K`).
The kernel takes d, dmin, sc and mn as they are (its two-level layout) and computes with
w = d'*q - m', d' = f16(d*sc[s]) and m' = f16(dmin*mn[s]): the levels are exact, only the two
products are rounded to float16 (relative error <= 2^-11).

`published_blocks` picks the Q4_K tensors of a GGUF that are weights of a model's Linear layers,
named as the model names them and with rows in the model's order (transformers' own GGUF name map
and tensor processor, so e.g. a Llama's q/k row permutation is undone as for the float weights).
They are stored raw (`save_published`) and decoded one Linear at a time on load (`PublishedWeights`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map,
                                                      read_field)

from fly_llm.model.kernels.w4a8 import SUPER, SuperBlockWeight

log = logging.getLogger(__name__)

SUPER_BLOCK = 256  # weights per Q4_K super-block
BLOCK_BYTES = 144  # bytes per Q4_K super-block
FORMAT = "gguf-q4_k"  # the safetensors metadata tag of a file `save_published` wrote


def decode(blocks: torch.Tensor) -> SuperBlockWeight:
    """Raw Q4_K rows (uint8 [n, k/256*144]) as levels q (uint8 [n, k]), float16 d and dmin per 256
    weights and their 6-bit multipliers per 32 (uint8)."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % BLOCK_BYTES:
        raise ValueError(f"Q4_K rows are uint8 [n, multiple of {BLOCK_BYTES}], not {blocks.dtype} "
                         f"{list(blocks.shape)}")
    n, supers = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES
    raw = blocks.reshape(n, supers, BLOCK_BYTES)
    d = raw[..., 0:2].contiguous().view(torch.float16).reshape(n, supers)
    dmin = raw[..., 2:4].contiguous().view(torch.float16).reshape(n, supers)
    packed = raw[..., 4:16].to(torch.int32)
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low & 63, (extra & 15) | ((low >> 2) & 48)], dim=-1)  # [n, supers, 8]
    minimums = torch.cat([high & 63, (extra >> 4) | ((high >> 2) & 48)], dim=-1)
    nibbles = raw[..., 16:].reshape(n, supers, 4, 1, 32)  # 32 bytes: sub-blocks 2j (low) and 2j + 1 (high)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=3).reshape(n, supers * SUPER_BLOCK)
    return SuperBlockWeight(q.contiguous(), d, dmin, scales.to(torch.uint8).reshape(n, supers * SUPER),
                            minimums.to(torch.uint8).reshape(n, supers * SUPER))


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


def published_blocks(gguf: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The GGUF's Q4_K tensors that are weights of `model`'s Linear layers (a meta-device skeleton
    will do): raw Q4_K rows by Linear name, rows in the model's order."""
    reader = GGUFReader(gguf)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    linears = {f"{name}.weight": module for name, module in model.named_modules() if type(module) is nn.Linear}
    found = {}
    for tensor in reader.tensors:
        if tensor.tensor_type != GGMLQuantizationType.Q4_K or tensor.data.ndim != 2:
            continue
        rows, width = tensor.data.shape
        mapped = _row_order(processor, tensor.name, rows, names)
        linear = linears.get(mapped[0]) if mapped else None
        if linear is None or tuple(linear.weight.shape) != (rows, width // BLOCK_BYTES * SUPER_BLOCK):
            continue
        found[mapped[0].removesuffix(".weight")] = torch.from_numpy(np.ascontiguousarray(tensor.data[mapped[1]]))
    return found


def save_published(blocks: Mapping[str, torch.Tensor], path: Path) -> None:
    """Write raw Q4_K rows by Linear name to a safetensors file (possibly with none)."""
    save_file(dict(blocks), str(path), metadata={"format": FORMAT})


class PublishedWeights(Mapping[str, SuperBlockWeight]):
    """The Linear weights of a `save_published` file, each decoded when asked for (for `quantize(published=)`)."""

    def __init__(self, path: Path) -> None:
        self._file = safe_open(str(path), framework="pt")
        if (self._file.metadata() or {}).get("format") != FORMAT:
            raise ValueError(f"{path} is not a file of published Q4_K weights")
        self._names = list(self._file.keys())

    def __getitem__(self, name: str) -> SuperBlockWeight:
        if name not in self._names:
            raise KeyError(name)
        return decode(self._file.get_tensor(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
