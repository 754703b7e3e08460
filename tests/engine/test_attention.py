"""fly_llm.model.attention: row_attention: a query's output is bit-identical however the forward around it is shaped, and
equal (to rounding) to ordinary masked attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from fly_llm.model.attention import FLOAT32_SDPA, float32_sdpa, row_attention, row_mask, use_float32_attention

HEADS, KV_HEADS, DIM, LENGTH = 12, 2, 128, 101  # the embedded target's attention shape


class _Module(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS


def _attend(query, key, value, mask=None):
    return row_attention(_Module(), query, key, value, mask)[0]  # [B, q, H, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_in_a_prefill_a_verify_a_decode_step_and_a_ragged_batch(dtype):
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, LENGTH, DIM, dtype=dtype)
    k, v = torch.randn(1, KV_HEADS, LENGTH, DIM, dtype=dtype), torch.randn(1, KV_HEADS, LENGTH, DIM, dtype=dtype)
    prefill = _attend(q, k, v)  # causal, no mask
    decode = _attend(q[:, :, -1:], k, v)
    verify_mask = torch.ones(3, LENGTH, dtype=torch.bool).tril(LENGTH - 3)[None, None]
    verify = _attend(q[:, :, -3:], k, v, verify_mask)
    # Row 0 of a batch: 7 columns of left padding and 5 "holes" (rejected drafts) before the last 3 queries.
    pad, holes = 7, 5
    width = pad + LENGTH + holes

    def spread(x):
        out = torch.randn(2, x.shape[1], width, DIM, dtype=dtype)
        out[0, :, pad:pad + LENGTH - 3] = x[0, :, :LENGTH - 3]
        out[0, :, width - 3:] = x[0, :, LENGTH - 3:]
        return out

    keep = torch.zeros(width, dtype=torch.bool)
    keep[pad:pad + LENGTH - 3] = True
    keep[width - 3:] = True
    mask = torch.zeros(2, 1, 3, width, dtype=torch.bool)
    mask[0, 0] = keep & (torch.arange(width) <= torch.arange(width - 3, width)[:, None])
    mask[1, 0] = torch.ones(3, width, dtype=torch.bool).tril(width - 3)
    ragged = _attend(spread(q)[:, :, -3:], spread(k), spread(v), mask)
    assert torch.equal(decode[0, 0], prefill[0, -1])
    assert torch.equal(verify[0], prefill[0, -3:])
    assert torch.equal(ragged[0], prefill[0, -3:])


def test_it_is_ordinary_masked_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, HEADS, 5, DIM), torch.randn(2, KV_HEADS, 20, DIM), torch.randn(2, KV_HEADS, 20, DIM)
    mask = torch.ones(2, 1, 5, 20, dtype=torch.bool).tril(15)
    mask[1, 0, :, :4] = False  # left padding
    mask[1, 0, 2] = False  # a padding query sees nothing: zeros
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    expected[1, 2] = 0
    torch.testing.assert_close(_attend(q, k, v, mask), expected)


def test_half_precision_attends_in_float32_on_cpu():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, HEADS, 4, DIM), torch.randn(1, KV_HEADS, 30, DIM), torch.randn(1, KV_HEADS, 30, DIM)
    mask = torch.ones(1, 1, 4, 30, dtype=torch.bool).tril(26)
    half = [x.bfloat16() for x in (q, k, v)]
    rows = _attend(*half, mask)
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, _attend(*(x.float() for x in half), mask).bfloat16())
    module = _Module()
    module.is_causal = True
    upcast = float32_sdpa(module, *half, mask)[0]
    assert upcast.dtype == torch.bfloat16
    assert torch.equal(upcast, sdpa_attention_forward(module, *(x.float() for x in half), mask)[0].bfloat16())


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, FLOAT32_SDPA), (torch.float32, "sdpa")])
def test_only_half_precision_models_switch_to_float32_sdpa(dtype, expected):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(dtype)
    use_float32_attention(model)
    assert model.config._attn_implementation == expected
    ids = torch.tensor([[1, 2, 3, 4]])
    assert model(ids).logits.dtype == dtype


@pytest.mark.parametrize("q_len", [1, 4])
def test_row_mask_is_transformers_causal_mask_over_the_padding_mask(q_len):
    """`row_mask` (built once a forward by fused models) allows what transformers' sdpa_mask allows."""
    gen = torch.Generator().manual_seed(q_len)
    padding = (torch.rand(3, 20, generator=gen) > 0.3).long()  # holes and left padding, as BatchKV has
    padding[:, -q_len:] = 1
    expected = sdpa_mask(batch_size=3, q_length=q_len, kv_length=20, q_offset=20 - q_len, attention_mask=padding.bool(),
                         allow_is_causal_skip=False)[:, 0]
    mask = row_mask(padding, q_len)
    assert mask.is_contiguous() and torch.equal(mask.expand_as(expected), expected)
