"""Attention that computes every query token on its own, so its output does not depend on the
forward it is part of (docs/models.md, "Exact mode and quantization").

A float model tolerates the last-bit differences between attending from a 1-token decode step,
a 9-token verify forward and a 300-token prefill. A model with int8 activations does not: a value
that lands on the other side of a rounding boundary moves by a whole quantization step, and 28
layers amplify that into logit differences of ~1 (measured: up to 2.5 on the embedded target),
enough to change greedy tokens. With this attention each query row is one SDPA call over exactly
the key/value columns it may see, gathered in order, whatever else the forward holds (other
queries, other requests' rows, padding, the engine's masked-out "holes"). Together with
`Int8Linear`, which is row-independent too, a quantized target then gives bit-identical results
for a token however it is scheduled, and exact mode reproduces its greedy output token for token.

It costs one SDPA call per query token and layer: measured +1 ms on a 1-token forward of the
embedded target, +20–25 ms on a 4–16-token one (150–400 ms forwards).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROW_ATTENTION = "fly_row_attention"


def row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, H, q, D], key/value [B, Hkv, kv, D], a boolean
    mask [B, 1, q, kv] (True: may attend) or None (causal, no padding). Returns [B, q, H, D]."""
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    if attention_mask is None:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        allowed = allowed.expand(batch, q_len, kv_len)
    else:
        mask = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
        allowed = mask.expand(batch, q_len, kv_len)
    out = query.new_zeros(batch, q_len, heads, query.shape[-1])
    gqa = heads != key.shape[1]
    for b in range(batch):
        columns = allowed[b].any(dim=0).nonzero().squeeze(1)
        seen = allowed[b][:, columns]
        # Each query may see a prefix of the row's columns (causal over the kept ones): gather once.
        prefix = bool((seen[:, 1:] <= seen[:, :-1]).all()) if seen.shape[1] > 1 else True
        keys, values = key[b:b + 1, :, columns], value[b:b + 1, :, columns]
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
    return out, None


AttentionInterface.register(ROW_ATTENTION, row_attention)
AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)


def use_row_attention(model: torch.nn.Module) -> None:
    """Switch `model` (a transformers model) to `row_attention`."""
    model.set_attn_implementation(ROW_ATTENTION)
