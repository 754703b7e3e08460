"""One W4A8 matmul where a decoder layer makes several on the same input (issue 34, "a lean step").

A Llama-family layer (Llama, Qwen2, Mistral: `q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`
with SiLU) projects one normed input three times for attention and twice for the MLP. With W4A8
weights `fuse(model)` concatenates each set into one packed weight: the activations are quantized
once and every weight block is streamed in one kernel call instead of three or two. The kernel
computes each output column on its own (fly_llm.model.kernels.w4a8), so a fused layer's output is the
unfused layer's bit for bit; what goes away is per-call work (quantizing the input, thread
dispatch, Python module calls).
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fly_llm.model.kernels import w4a8

_ATTENTION = {"LlamaAttention", "Qwen2Attention", "MistralAttention"}
_MLP = {"LlamaMLP", "Qwen2MLP", "MistralMLP"}


class FusedW4A8(nn.Module):
    """Several W4A8 linears over the same input as one: their outputs side by side, [..., sum of widths]."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.in_features = layers[0].in_features
        self.widths = [layer.out_features for layer in layers]
        self.out_features = sum(self.widths)
        parts = [layer.packed for layer in layers]  # whole groups of COLUMNS each (see `fusable`)
        self.packed = w4a8.PackedWeight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")),
                                        n=self.out_features)
        biases = [layer.bias if layer.bias is not None else torch.zeros(layer.out_features) for layer in layers]
        any_bias = any(layer.bias is not None for layer in layers)
        self.register_buffer("bias", torch.cat(biases).float().contiguous() if any_bias else None)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        rows = x.reshape(-1, self.in_features)
        out = w4a8.linear(rows.contiguous(), self.packed, self.bias)
        return list(out.reshape(*x.shape[:-1], self.out_features).to(x.dtype).split(self.widths, dim=-1))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, widths={self.widths}, w4a8 block {w4a8.BLOCK}"


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                       attention_mask: torch.Tensor | None, cache=None, **kwargs):
    """transformers' Llama/Qwen2 attention forward with q, k and v from one `qkv_proj` call."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = (x.view(hidden_shape).transpose(1, 2) for x in self.qkv_proj(hidden_states))
    cos, sin = position_embeddings
    query, key = self.fused_rotary(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    if getattr(self, "sliding_window", None) is not None:
        kwargs["sliding_window"] = self.sliding_window
    out, weights = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up from one `gate_up_proj` call, then down."""
    gate, up = self.gate_up_proj(x)
    return self.down_proj(F.silu(gate) * up)


def fusable(*layers: nn.Module) -> bool:
    """Whether `layers` are W4A8 linears of one input width whose packed weights can be concatenated
    (every output width but the last a whole number of COLUMNS-wide groups)."""
    from fly_llm.model.quantization import W4A8Linear  # here: quantization imports this module

    return (all(isinstance(layer, W4A8Linear) for layer in layers)
            and len({layer.in_features for layer in layers}) == 1
            and all(layer.out_features % w4a8.COLUMNS == 0 for layer in layers[:-1]))


def fuse(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up of every Llama-family layer of `model` whose projections are W4A8; returns
    how many modules were fused. Other layers and architectures are left as they are."""
    fused = 0
    for module in model.modules():
        kind = type(module).__name__
        if kind in _ATTENTION and fusable(module.q_proj, module.k_proj, module.v_proj):
            module.qkv_proj = FusedW4A8([module.q_proj, module.k_proj, module.v_proj])
            del module.q_proj, module.k_proj, module.v_proj
            module.fused_rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
            module.forward = types.MethodType(_attention_forward, module)
            fused += 1
        elif kind in _MLP and module.config.hidden_act == "silu" and fusable(module.gate_proj, module.up_proj):
            module.gate_up_proj = FusedW4A8([module.gate_proj, module.up_proj])
            del module.gate_proj, module.up_proj
            module.forward = types.MethodType(_mlp_forward, module)
            fused += 1
    return fused
