"""The W4A8 layers that quantization puts in a model and fusion joins (fly_llm.model.kernels.w4a8's matmul):
`W4A8Linear`, a Linear on a packed 4-bit weight with int8 activations, and `FusedW4A8`, several of them over
one input as one matmul. Below both fly_llm.model.quantization and fly_llm.model.fused_layers (an import
contract), so neither needs the other to know what a W4A8 layer is."""

from __future__ import annotations

import torch
from torch import nn

from fly_llm.model.kernels import w4a8

WeightLevels = w4a8.QuantizedWeight | w4a8.SuperBlockWeight | w4a8.SymmetricWeight  # what W4A8Linear packs as it is


class PackedW4A8(nn.Module):
    """A layer on a packed W4A8 weight (`packed`, and `bias` float32 [n] or None): W4A8Linear, FusedW4A8."""

    packed: w4a8.Packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] in x's dtype."""
        return self.project(x, w4a8.isa_code())

    def project(self, x: torch.Tensor, code: int) -> torch.Tensor:
        """`forward` on the kernel's path `code` (`w4a8.isa_code`), looked up once by the caller."""
        return w4a8.project(x, self.packed, self.bias, code)


class W4A8Linear(PackedW4A8):
    """A Linear with 4-bit weights (blocks of 32 inputs, scale and minimum each) and int8 activations."""

    def __init__(self, linear: nn.Linear, weight: WeightLevels | None = None) -> None:
        """`weight`: the linear's weight already in levels (a GGUF's published blocks: Q4_K, Q5_K, Q4_1, Q5_1,
        or Q6_K, Q8_0, Q5_0, Q4_0 as symmetric blocks); None rounds `linear.weight` to 4 bits
        (`w4a8.quantize_weight`)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if weight is not None and tuple(weight.q.shape) != (self.out_features, self.in_features):
            raise ValueError(f"a published weight of shape {tuple(weight.q.shape)} for a "
                             f"{self.out_features}x{self.in_features} Linear")
        if isinstance(weight, w4a8.SymmetricWeight):
            self.packed = w4a8.pack_symmetric(weight)
        else:
            self.packed = w4a8.pack(weight if weight is not None else w4a8.quantize_weight(linear.weight))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w4a8 block {w4a8.BLOCK}"


class FusedW4A8(PackedW4A8):
    """Several W4A8 linears over the same input as one: their outputs side by side, [..., sum of widths]."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.in_features = layers[0].in_features
        self.widths = [layer.out_features for layer in layers]
        self.out_features = sum(self.widths)
        self.packed = w4a8.concat([layer.packed for layer in layers])  # whole groups each (see `fusable`)
        biases = [layer.bias if layer.bias is not None else torch.zeros(layer.out_features) for layer in layers]
        any_bias = any(layer.bias is not None for layer in layers)
        self.register_buffer("bias", torch.cat(biases).float().contiguous() if any_bias else None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, widths={self.widths}, w4a8 block {w4a8.BLOCK}"


def fusable(*layers: nn.Module) -> bool:
    """Whether `layers` are W4A8 linears of one input width whose packed weights can be concatenated
    (every output width but the last a whole number of COLUMNS-wide groups)."""
    return (all(isinstance(layer, W4A8Linear) for layer in layers)
            and len({layer.in_features for layer in layers}) == 1
            and all(layer.out_features % w4a8.COLUMNS == 0 for layer in layers[:-1]))
