"""Attention implementations for transformers models on CPU (docs/models.md, "Attention on CPU").

`row_attention` computes every query token on its own, so its output does not depend on the
forward it is part of ("Exact mode and quantization"); `float32_sdpa` is transformers' SDPA with
its inputs upcast. Both attend in float32 on CPU: there, PyTorch's bfloat16 SDPA over one query
is ~10× slower than float32 (measured, torch 2.13, 2 threads, 12 heads × 128, 512 keys: 0.56 vs
0.05 ms a call), which made a bf16 1.5B model's 28 attention calls cost ~15 ms of a 65 ms decode
step; upcasting is exact and costs nothing measurable on a prefill.

A float model tolerates the last-bit differences between attending from a 1-token decode step,
a 9-token verify forward and a 300-token prefill. A model with int8 activations does not: a value
that lands on the other side of a rounding boundary moves by a whole quantization step, and 28
layers amplify that into logit differences of ~1 (measured: up to 2.5 on the embedded target),
enough to change greedy tokens. With this attention each query row attends over exactly the
key/value columns it may see, in order, whatever else the forward holds (other queries, other
requests' rows, padding, the engine's masked-out "holes"). Together with the quantized Linear
layers, which are row-independent too, a quantized target then gives bit-identical results for a
token however it is scheduled, and exact mode reproduces its greedy output token for token.

On an x86 CPU it is one call per layer of a C++ op (fly_llm.model.kernels.row_attention: a fixed-order
float32 loop per query, head and allowed column); elsewhere `reference_row_attention`, one SDPA
call per query token and layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fly_llm.model.kernels import row_attention as native

ROW_ATTENTION = "fly_row_attention"
FLOAT32_SDPA = "fly_float32_sdpa"


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32 on CPU (its SDPA kernels are the fast ones there), else the tensor's own dtype."""
    return torch.float32 if tensor.device.type == "cpu" else tensor.dtype


def _allowed(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The boolean [B, q, kv] mask of which columns each query may see (None: causal, no padding)."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
    return mask.expand(query.shape[0], query.shape[2], key.shape[2])


def row_mask(attention_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """The boolean [B, q, kv] mask row attention gets in a forward of q tokens over a 2D padding mask
    [B, kv] (nonzero: a kept column) after kv - q cached columns: what transformers' causal mask
    (`sdpa_mask`) gives, built directly (fly_llm.model.fused_layers builds it once a forward)."""
    kv_len = attention_mask.shape[1]
    kept = attention_mask.bool()[:, None, :]
    if q_len == 1:
        return kept  # the one query sees every kept column
    columns = torch.arange(kv_len, device=attention_mask.device)
    causal = columns <= torch.arange(kv_len - q_len, kv_len, device=attention_mask.device)[:, None]
    return kept & causal


def native_runs(query: torch.Tensor) -> bool:
    """Whether the C++ op (fly_llm.model.kernels.row_attention) computes this call: CPU, float32 or bfloat16."""
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16) and native.available()


def row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, q, D], key/value [B, Hkv, kv, D], a boolean
    mask [B, 1, q, kv] (True: may attend) or None (causal, no padding). Returns [B, q, H, D].

    On a CPU where it builds, one call of the C++ op per layer; elsewhere `reference_row_attention`."""
    if not (native_runs(query) and key.dtype == query.dtype and value.dtype == query.dtype):
        return reference_row_attention(module, query, key, value, attention_mask, scaling=scaling)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return native.attention(query, key, value, _allowed(query, key, attention_mask), scale), None


def reference_row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """`row_attention` in torch: one SDPA call per query token over its gathered columns (any device)."""
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    dtype = _compute_dtype(query)
    allowed = _allowed(query, key, attention_mask)
    if allowed is None:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        allowed = allowed.expand(batch, q_len, kv_len)
    out = query.new_zeros(batch, q_len, heads, query.shape[-1], dtype=dtype)
    in_dtype, query = query.dtype, query.to(dtype)
    gqa = heads != key.shape[1]
    for b in range(batch):
        columns = allowed[b].any(dim=0).nonzero().squeeze(1)
        seen = allowed[b][:, columns]
        # Each query may see a prefix of the row's columns (causal over the kept ones): gather once.
        prefix = bool((seen[:, 1:] <= seen[:, :-1]).all()) if seen.shape[1] > 1 else True
        keys, values = key[b:b + 1, :, columns].to(dtype), value[b:b + 1, :, columns].to(dtype)
        for i, count in enumerate(seen.sum(dim=1).tolist()):
            if not count:
                continue  # a padding query: attends to nothing, outputs zeros
            if prefix:
                k, v = keys[:, :, :count], values[:, :, :count]
            else:
                own = seen[i].nonzero().squeeze(1)
                k, v = keys[:, :, own], values[:, :, own]
            out[b, i] = F.scaled_dot_product_attention(query[b:b + 1, :, i:i + 1], k, v, scale=scaling,
                                                       enable_gqa=gqa)[0, :, 0]
    return out.to(in_dtype), None


def float32_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, computed in float32 on CPU; returns [B, q, H, D] in the input dtype."""
    dtype = _compute_dtype(query)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.to(dtype)
    out, _ = sdpa_attention_forward(module, query.to(dtype), key.to(dtype), value.to(dtype), attention_mask,
                                    **kwargs)
    return out.to(query.dtype), None


for _name, _function in ((ROW_ATTENTION, row_attention), (FLOAT32_SDPA, float32_sdpa)):
    AttentionInterface.register(_name, _function)
    AttentionMaskInterface.register(_name, sdpa_mask)


def use_row_attention(model: torch.nn.Module) -> None:
    """Switch `model` (a transformers model) to `row_attention`."""
    model.set_attn_implementation(ROW_ATTENTION)


def use_float32_attention(model: torch.nn.Module) -> None:
    """Switch a half-precision transformers model on CPU from SDPA to `float32_sdpa` (others unchanged)."""
    weight = next(model.parameters())
    half = weight.dtype in (torch.bfloat16, torch.float16)
    if half and weight.device.type == "cpu" and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(FLOAT32_SDPA)
