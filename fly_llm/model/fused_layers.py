"""A Llama-family decoder layer with W4A8 projections as few calls as it can be (issue 34, "a lean step").

A Llama-family layer (Llama, Qwen2, Mistral: `q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`
with SiLU) projects one normed input three times for attention and twice for the MLP. With W4A8
weights `fuse(model)` converts the model: each attention becomes a `FusedAttention` and each MLP a
`FusedMLP` (modules replaced, not forwards patched) whose projections are concatenated into one packed
weight: the activations are quantized once and every weight block is streamed in one kernel call
instead of three or two. The kernel computes each output column on its own
(fly_llm.model.kernels.w4a8), so the fused matmuls give the unfused ones' outputs bit for bit.

A layer whose attention and MLP are both fused becomes a `FusedDecoderLayer`, which runs its small ops natively
(fly_llm.model.kernels.layer_ops): RMSNorm, then the residual add and the second RMSNorm in one call,
rotary in place on the q/k/v output (q, k and v are views of it: no copies before the cache
write), SiLU(gate) * up in one call. A fused layer is then: rms_norm, qkv matmul, rotary, cache
update, row attention, o_proj, add_rms_norm, gate/up matmul, silu_mul, down, residual add. Those
ops differ from transformers' in float32's last bits at most (a sum's order, exp), so a fused model's
logits are the unfused model's to a tolerance, not bit for bit; every op is row-independent, so
exact mode still reproduces the fused model's own greedy output. Where the native ops cannot run,
their torch fallbacks are transformers' arithmetic and the fused model is the unfused one bit for bit.

Such a layer is also lean in Python: it looks the kernel's path ($FLY_W4A8_ISA) up once, not once
a matmul, and calls its attention, MLP and W4A8 projections as plain functions (`PackedW4A8.project`),
not through nn.Module's call; the same kernels in the same order, so the same outputs bit for bit.
A model whose layers are all fused also gets a lean model forward (`_model_forward`) for the
engine's calls: the row-attention mask built once a forward, no transformers decorators or
per-layer module calls, and each layer's last residual add joined to the next layer's RMSNorm;
the same logits bit for bit again (tests/engine/test_fused_layers.py). That one is the instance's
`forward`, the model keeping its class: transformers keys what a model records on its class, and
every other call (hidden states asked for, HF `generate`'s) takes that class's own forward.
"""

from __future__ import annotations

import functools
import types
from typing import NamedTuple

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralDecoderLayer, MistralMLP, MistralModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2MLP, Qwen2Model

from fly_llm.model import attention
from fly_llm.model.kernels import layer_ops, row_attention, w4a8
from fly_llm.model.w4a8_layers import FusedW4A8, PackedW4A8, fusable

# The Llama family as transformers writes it: what `fuse` converts (by class, so a subclass counts too).
_ATTENTION = (LlamaAttention, Qwen2Attention, MistralAttention)
_MLP = (LlamaMLP, Qwen2MLP, MistralMLP)
_LAYER = (LlamaDecoderLayer, Qwen2DecoderLayer, MistralDecoderLayer)
_MODEL = (LlamaModel, Qwen2Model, MistralModel)


class FusedAttention(nn.Module):
    """A Llama-family attention whose q, k and v are one W4A8 matmul (`qkv_proj`), q and k rotated in place
    on its output; `o_proj` and the attention function (`config._attn_implementation`) as before."""

    def __init__(self, original: nn.Module) -> None:
        """Take over `original`'s projections (q/k/v concatenated) and what attention functions read of it."""
        super().__init__()
        self.config, self.layer_idx, self.head_dim = original.config, original.layer_idx, original.head_dim
        self.scaling, self.is_causal = original.scaling, original.is_causal
        self.num_key_value_groups, self.attention_dropout = original.num_key_value_groups, original.attention_dropout
        self.sliding_window = getattr(original, "sliding_window", None)  # Llama has none
        self.qkv_proj = FusedW4A8([original.q_proj, original.k_proj, original.v_proj])
        self.o_proj = original.o_proj
        self.head_counts = [width // self.head_dim for width in self.qkv_proj.widths]
        self.train(original.training)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """transformers' Llama/Qwen2 attention forward with q, k and v from one `qkv_proj` call."""
        return _attend(self, hidden_states, position_embeddings, attention_mask, cache, w4a8.isa_code(), kwargs)


class FusedMLP(nn.Module):
    """A Llama-family SiLU MLP whose gate and up projections are one W4A8 matmul (`gate_up_proj`), SiLU·mul native."""

    def __init__(self, original: nn.Module) -> None:
        """Take over `original`'s projections (gate/up concatenated)."""
        super().__init__()
        self.config = original.config
        self.gate_up_proj = FusedW4A8([original.gate_proj, original.up_proj])
        self.down_proj = original.down_proj
        self.train(original.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up from one `gate_up_proj` call, then down."""
        return _mlp(self, x, w4a8.isa_code())


class FusedDecoderLayer(nn.Module):
    """A Llama-family decoder layer over a FusedAttention and a FusedMLP, its norms and first residual add native.

    `fuse` makes a layer this by its class (`_fused_layer_class`: this forward before transformers'), not
    a new module: transformers records hidden states from instances of its own layer class, so the layer
    stays one."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        """transformers' Llama/Qwen2 decoder layer with its norms and first residual add as native calls.

        Lean (issue 34): the kernel's path is looked up once a layer, and the attention, the MLP and
        their W4A8 projections are called as plain functions, not through nn.Module's call: hooks
        registered on those submodules do not run (the layer's own do)."""
        code = w4a8.isa_code()
        first, second = self.input_layernorm, self.post_attention_layernorm
        normed = layer_ops.rms_norm(hidden_states, first.weight, first.variance_epsilon)
        kwargs.update(position_ids=position_ids, use_cache=use_cache)  # what the attention module got before
        attended, _ = _attend(self.self_attn, normed, position_embeddings, attention_mask, cache, code, kwargs)
        hidden_states, normed = layer_ops.add_rms_norm(attended, hidden_states, second.weight, second.variance_epsilon)
        return hidden_states + _mlp(self.mlp, normed, code)


def _attend(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
            attention_mask: torch.Tensor | None, cache, code: int, kwargs: dict):
    """`FusedAttention.forward` with the projections on the kernel's path `code`."""
    input_shape = hidden_states.shape[:-1]
    query, key, value = _qkv(self, hidden_states, position_embeddings, code)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    if self.sliding_window is not None:
        kwargs["sliding_window"] = self.sliding_window
    out, weights = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
    return _project(self.o_proj, out.reshape(*input_shape, -1), code), weights


def _qkv(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
         code: int) -> list[torch.Tensor]:
    """Query [B, H, S, D], key and value [B, Hkv, S, D]: views of one `qkv_proj` output, q and k rotated in place."""
    batch, length, _ = hidden_states.shape
    qkv = self.qkv_proj.project(hidden_states, code)  # [B, S, (H + 2 Hkv) * D]
    cos, sin = position_embeddings
    heads, kv_heads, _ = self.head_counts
    layer_ops.rotary_(qkv, cos, sin, heads + kv_heads, self.head_dim)
    return torch.split_with_sizes(qkv.view(batch, length, -1, self.head_dim).transpose(1, 2), self.head_counts, 1)


def _mlp(self, x: torch.Tensor, code: int) -> torch.Tensor:
    """`FusedMLP.forward` with the projections on the kernel's path `code`."""
    return _project(self.down_proj, layer_ops.silu_mul(self.gate_up_proj.project(x, code)), code)


def _project(layer: nn.Module, x: torch.Tensor, code: int) -> torch.Tensor:
    """`layer(x)`, on the kernel's path `code` if it is a W4A8 layer (an o_proj or down_proj may be float)."""
    return layer.project(x, code) if isinstance(layer, PackedW4A8) else layer(x)


def _lean_layer(self, hidden_states: torch.Tensor, residual: torch.Tensor | None, step: "_Step",
                cache) -> tuple[torch.Tensor, torch.Tensor]:
    """`FusedDecoderLayer.forward` inside `_model_forward`: the residual stream comes in and goes out as (the MLP's
    output, the residual before it); their sum, the layer's output, is added by the next layer's
    first RMSNorm in one call (the same bf16 sum as `FusedDecoderLayer.forward`'s last add). The attention is
    row attention's native op with the forward's mask; the cache write joins rotary (`_rows_qkv`)."""
    first, second, attention = self.input_layernorm, self.post_attention_layernorm, self.self_attn
    if residual is None:
        residual, normed = hidden_states, layer_ops.rms_norm(hidden_states, first.weight, first.variance_epsilon)
    else:
        residual, normed = layer_ops.add_rms_norm(hidden_states, residual, first.weight, first.variance_epsilon)
    query, key, value = _rows_qkv(attention, normed, step, cache)
    out = row_attention.attention(query, key, value, step.mask, attention.scaling)  # [B, S, H, D]
    attended = _project(attention.o_proj, out.view(*out.shape[:2], -1), step.code)
    residual, normed = layer_ops.add_rms_norm(attended, residual, second.weight, second.variance_epsilon)
    return _mlp(self.mlp, normed, step.code), residual


def _rows_qkv(self, hidden_states: torch.Tensor, step: "_Step", cache) -> tuple[torch.Tensor, ...]:
    """The query [B, H, S, D] and the layer's cached keys and values [B, Hkv, kv, D] with this forward's
    appended. A cache layer with `open_columns` (fly_llm.decoding.cache.BufferLayer, once it holds
    something) gets them written by the native call that rotates q and k (`layer_ops.rotary_store_`);
    any other goes through `_qkv` and `cache.update`."""
    index = self.layer_idx
    layer = cache.layers[index] if index < len(cache.layers) else None
    if not (getattr(layer, "is_initialized", False) and hasattr(layer, "open_columns")):
        query, key, value = _qkv(self, hidden_states, step.rotary, step.code)
        return (query, *cache.update(key, value, index))
    batch, length, _ = hidden_states.shape
    qkv = self.qkv_proj.project(hidden_states, step.code)  # [B, S, (H + 2 Hkv) * D]
    heads, kv_heads, _ = self.head_counts
    layer_ops.rotary_store_(qkv, *step.rotary, heads, kv_heads, self.head_dim, *layer.open_columns(length))
    return qkv.view(batch, length, -1, self.head_dim)[:, :, :heads].transpose(1, 2), layer.keys, layer.values


class _Step(NamedTuple):
    """What every layer of one `_model_forward` shares: the kernel's path, rotary's cos/sin, the row mask."""

    code: int
    rotary: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor


def _model_forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, cache=None, inputs_embeds: torch.Tensor | None = None,
                   use_cache: bool | None = None, **kwargs) -> BaseModelOutputWithPast:
    """transformers' Llama/Qwen2 model forward (`LlamaModel.forward`) for a model whose layers are all fused,
    lean (issue 34): the row-attention mask is built once (`attention.row_mask`, not transformers'
    mask functions), the kernel's path is looked up once, and the layers run as `_lean_layer`
    calls, each first RMSNorm adding the previous layer's residual. The same ops on the same
    values as the stock forward with `FusedDecoderLayer.forward`, so the same logits bit for bit.

    It bypasses transformers' decorators (config defaults, output capture) and the layers' module
    calls (their hooks do not run), so it runs only for the engine's kind of call: token ids, a 2D
    mask, position ids, a cache, nothing else asked for, row attention native for the dtype.
    Any other call is transformers' own forward (with `FusedDecoderLayer.forward`)."""
    if not (input_ids is not None and inputs_embeds is None and attention_mask is not None
            and attention_mask.dim() == 2 and position_ids is not None and cache is not None and use_cache
            and not kwargs and not self.training and self.config._attn_implementation == attention.ROW_ATTENTION):
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden_states = self.embed_tokens(input_ids)
    if not attention.native_runs(hidden_states):
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache)
    step = _Step(w4a8.isa_code(), self.rotary_emb(hidden_states, position_ids),
                 attention.row_mask(attention_mask, input_ids.shape[1]))
    residual = None
    for layer in self.layers:
        hidden_states, residual = _lean_layer(layer, hidden_states, residual, step, cache)
    return BaseModelOutputWithPast(last_hidden_state=self.norm(residual + hidden_states), cache=cache)


def fuse(model: nn.Module) -> int:
    """Convert `model`: every Llama-family attention whose q/k/v are W4A8 is replaced by a FusedAttention, every
    SiLU MLP whose gate/up are W4A8 by a FusedMLP (the same weights, concatenated); a decoder layer with both
    becomes a FusedDecoderLayer (`_fused_layer_class`), and a model whose layers all are gets the lean model forward
    (`_model_forward`). Returns how many modules were converted. Other layers and architectures are left as
    they are."""
    fused = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _ATTENTION) and fusable(child.q_proj, child.k_proj, child.v_proj):
                setattr(parent, name, FusedAttention(child))
            elif (isinstance(child, _MLP) and child.config.hidden_act == "silu"
                  and fusable(child.gate_proj, child.up_proj)):
                setattr(parent, name, FusedMLP(child))
            else:
                continue
            fused += 1
    for module in model.modules():  # after the loop above: a layer's attention and MLP are converted first
        if (isinstance(module, _LAYER) and not isinstance(module, FusedDecoderLayer)
                and isinstance(module.self_attn, FusedAttention) and isinstance(module.mlp, FusedMLP)):
            module.__class__ = _fused_layer_class(type(module))
            fused += 1
    for module in model.modules():
        # The model keeps its class, and this one forward is the instance's (`_model_forward`): transformers
        # keys what a model records (hidden states, attentions) on the model's class, and every other call
        # needs that class's own forward.
        if isinstance(module, _MODEL) and _lean_model(module):
            module.forward = types.MethodType(_model_forward, module)
            fused += 1
    return fused


@functools.cache
def _fused_layer_class(original: type[nn.Module]) -> type[nn.Module]:
    """`original` (a transformers decoder layer class) with FusedDecoderLayer's forward first
    (`FusedQwen2DecoderLayer`, ...): a layer made one keeps its modules, hooks and transformers' isinstance checks."""
    return type(f"Fused{original.__name__}", (FusedDecoderLayer, original), {"__module__": __name__})


def _lean_model(model: nn.Module) -> bool:
    """Whether `_model_forward` can run `model` (a LlamaModel-like one): every layer fused, full attention only."""
    layers = getattr(model, "layers", None)
    return (layers is not None and len(layers) == model.config.num_hidden_layers
            and not getattr(model, "has_sliding_layers", False)
            and set(getattr(model.config, "layer_types", None) or ["full_attention"]) == {"full_attention"}
            and all(isinstance(layer, FusedDecoderLayer) and layer.self_attn.sliding_window is None
                    for layer in layers))
