"""Quantized weights for a loaded model's Linear layers, target and draft alike (docs/models.md).

Three layers replace `torch.nn.Linear`: one on this project's own kernel, two on kernels that
torch itself ships:

- `W4A8Linear` (fly_llm.model.w4a8_layers): 4-bit weights in blocks of 32 (a scale and a minimum each, as GGUF's Q4_K
  sub-blocks) and int8 activations per row and block, on integer dot products
  (fly_llm.model.kernels.w4a8: AVX-512 VNNI, else AVX2; compiled on first use). A row's result is the
  same bit for bit whatever else is in the batch, on either path and any thread count. 'auto'
  on a CPU with AVX-512 VNNI. Where the kernel cannot be built or run, the choice falls back to
  int8 with a log line.
- `Int8Linear`: int8 weights per output channel and int8 activations per token, on fbgemm's
  int8 matmul (`torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32`, x86 CPUs).
  'auto' elsewhere: of torch's kernels the only one measured here that is cheaper than float at
  every width a speculative round uses (one new token and K+1 of them). The kernel quantizes its
  whole input with one given scale; each row is therefore divided by its own largest magnitude
  first, so the scale is the same on every call: a row's result depends on that row only, bit for bit, whatever else is
  in the batch. That keeps exact mode lossless with respect to the quantized target, and one
  request's outputs independent of its neighbours'.
- `Int4Linear`: int4 weights in groups of 32 with a scale and a minimum each (as GGUF's Q4_K
  blocks), on torch's weight-only kernel (`aten._weight_int4pack_mm_for_cpu`), activations in
  bfloat16. Half the memory of int8; slower than int8 at verify widths on the CPUs measured.

torchao's configs were measured too (docs/models.md): on a CPU without torch.compile they ran
4-40x slower than these kernels, so they are not used.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import nn
from transformers import PreTrainedModel

from fly_llm.common.config import QUANTIZATIONS
from fly_llm.common.errors import ModelError
from fly_llm.model.fused_layers import fuse
from fly_llm.model.huge_pages import in_huge_pages
from fly_llm.model.attention import use_row_attention
from fly_llm.model.kernels import row_attention as native_attention
from fly_llm.model.kernels import w4a8
from fly_llm.model.w4a8_layers import PackedW4A8, W4A8Linear, WeightLevels


log = logging.getLogger(__name__)

# Rows scaled into [-1, 1] map onto 0..127 (zero at 64): 7-bit activations, as torch's x86 int8
# kernels use them (u8·s8 pairs summed in int16 would saturate with 8 bits on AVX2).
_INPUT_SCALE, _INPUT_ZERO = 2 / 127, 64
INT4_GROUP = 32
_INT4_INNER_K_TILES = 2
_INT4_OUTPUT_MULTIPLE = 16  # the packing kernel's requirement on the output width


def int8_available() -> bool:
    """Whether torch has fbgemm's int8 matmul (an x86 CPU build)."""
    engines = torch.backends.quantized.supported_engines
    return ("x86" in engines or "fbgemm" in engines) and hasattr(
        torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")


def int4_available() -> bool:
    """Whether torch has its CPU int4 weight-only matmul."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int8Linear(nn.Module):
    """A Linear with int8 weights (per output channel) and int8 activations (per token)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        zero = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch warns that quantized tensor types will move to torchao
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        peak = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True).clamp(min=1e-12)
        out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            rows / peak, _INPUT_SCALE, _INPUT_ZERO, self._packed) * peak
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(nn.Module):
    """A Linear with int4 weights in groups of INT4_GROUP input features (scale and minimum each)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        groups = weight.reshape(self.out_features, -1, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-8)
        levels = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            levels.reshape(self.out_features, self.in_features), _INT4_INNER_K_TILES)
        self.register_buffer("packed", packed)
        # The kernel computes (level - 8) * scale + zero, so zero = low + 8 * scale.
        scales_and_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP,
                                                          self.scales_and_zeros).float()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {INT4_GROUP}"


_LAYERS: dict[str, type[nn.Module]] = {"w4a8": W4A8Linear, "int8": Int8Linear, "int4": Int4Linear}
_AVAILABLE = {"w4a8": w4a8.available, "int8": int8_available, "int4": int4_available}
_KERNELS = {"w4a8": "fly_llm.model.kernels.w4a8 (a C++ compiler and an x86 CPU with AVX2)",
            "int8": "fbgemm's int8 matmul (an x86 CPU build of torch)", "int4": "aten._weight_int4pack_mm_for_cpu"}


def auto_scheme() -> str:
    """'auto' on a CPU: w4a8 where its kernel builds and runs (x86 with AVX2 and FMA, or AVX-512 VNNI),
    else int8 where torch has it, else none.

    Why (docs/models.md, benchmarks/results/kernel): on an AVX-512 VNNI CPU a w4a8 forward of the
    embedded target is 1.6x cheaper than int8 over one new token and cheaper over sixteen, and agrees
    with the float target more often. On AVX2 alone (both paths forced on an AVX-512 CPU: the kernel's
    AVX2 path, fbgemm's with FBGEMM_ENABLE_INSTRUCTIONS=AVX2) it is 1.6x cheaper at one token and 1.2x
    at four, 11-13% dearer at eight and sixteen; decoding is mostly one-token steps and short verifies.
    """
    if _AVAILABLE["w4a8"]():
        return "w4a8"
    return "int8" if _AVAILABLE["int8"]() else "none"


def resolve_quantization(mode: str, device: torch.device, role: str = "target") -> str:
    """'none', 'w4a8', 'int8' or 'int4' for `mode` on `device`; 'auto' on a CPU: `auto_scheme()`.

    GPUs keep their float weights. 'w4a8' where its kernel cannot be built or run is int8
    (logged); any other explicit choice that cannot run here is a ModelError naming what is missing.
    """
    if mode not in QUANTIZATIONS:
        raise ModelError(f"unknown {role}_quantization {mode!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if mode == "none":
        return "none"
    if device.type != "cpu":
        if mode == "auto":
            return "none"
        raise ModelError(f"{role}_quantization={mode!r} runs on CPU only (the device is {device}); use 'none'")
    if mode == "auto":
        return auto_scheme()
    if mode == "w4a8" and not _AVAILABLE["w4a8"]() and _AVAILABLE["int8"]():
        log.warning("%s_quantization='w4a8': its kernel cannot run here (see above); using int8", role)
        return "int8"
    if not _AVAILABLE[mode]():
        raise ModelError(f"{role}_quantization={mode!r} needs {_KERNELS[mode]}, which this torch lacks; "
                         "use 'none' or 'auto'")
    return mode


def _unpackable(scheme: str, linear: nn.Linear) -> bool:
    """Whether `scheme`'s kernel cannot take `linear`'s widths (it then stays in float)."""
    if scheme == "int4":
        return bool(linear.in_features % INT4_GROUP or linear.out_features % _INT4_OUTPUT_MULTIPLE)
    return scheme == "w4a8" and linear.in_features % w4a8.BLOCK != 0


def quantize(model: nn.Module, mode: str, device: torch.device, role: str = "target",
             published: Mapping[str, WeightLevels] | None = None) -> str:
    """Replace `model`'s Linear layers in place by quantized ones; returns the scheme applied.

    `published` maps Linear names (as `model.named_modules()` gives them) to weights in levels taken
    as they are under w4a8 instead of rounding the float weight again (other schemes ignore it).

    Every Linear is replaced, the output head included (a Linear whose input width is not a
    multiple of 32, or under int4 whose output width is not one of 16, stays as it is). A
    transformers target is switched to `row_attention`, so that each token's result is independent
    of the forward it is in; a draft too where its C++ op runs (cheaper than SDPA over one new token,
    and a draft's proposals then do not depend on the batch either). Embeddings, norms and
    attention keep the model's dtype.
    """
    scheme = resolve_quantization(mode, device, role)
    if scheme == "none":
        return scheme
    layer = _LAYERS[scheme]
    given = published if scheme == "w4a8" and published else {}
    kept = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if _unpackable(scheme, child):
                kept += 1
                continue
            weight = given.get(f"{parent_name}.{name}" if parent_name else name)
            setattr(parent, name, layer(child, weight) if weight is not None else layer(child))
    if kept:
        log.info("%s: %d Linear layers kept in float (widths the %s kernel cannot pack)", role, kept, scheme)
    if scheme == "w4a8":
        fuse(model)  # q/k/v and gate/up as one matmul each: the same outputs, bit for bit
        place_packed(model, in_huge_pages)  # streamed every step: 2 MiB pages, one copy each once fused
    if isinstance(model, PreTrainedModel) and (role == "target" or native_attention.available()):
        use_row_attention(model)  # exact mode needs it; a draft gains batch invariance where it is native
    return scheme


def place_packed(model: nn.Module, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Put every packed w4a8 weight of `model` (its W4A8Linear and fused layers) where `place` copies it."""
    for module in model.modules():
        if isinstance(module, PackedW4A8):
            module.packed = module.packed.map(place)


def quantization_of(model: nn.Module) -> str:
    """'w4a8', 'int8', 'int4' or 'none': which quantized layers `model` holds."""
    for scheme, layer in _LAYERS.items():
        if any(isinstance(m, layer) for m in model.modules()):
            return scheme
    return "none"
