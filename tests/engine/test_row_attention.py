"""row_attention: a query's output is bit-identical however the forward around it is shaped, and
equal (to rounding) to ordinary masked attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fly_llm.row_attention import row_attention

HEADS, KV_HEADS, DIM, LENGTH = 12, 2, 128, 101  # the embedded target's attention shape


class _Module(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS


def _attend(query, key, value, mask=None):
    return row_attention(_Module(), query, key, value, mask)[0]  # [B, q, H, D]


def test_a_query_gets_the_same_bits_in_a_prefill_a_verify_a_decode_step_and_a_ragged_batch():
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, LENGTH, DIM)
    k, v = torch.randn(1, KV_HEADS, LENGTH, DIM), torch.randn(1, KV_HEADS, LENGTH, DIM)
    prefill = _attend(q, k, v)  # causal, no mask
    decode = _attend(q[:, :, -1:], k, v)
    verify_mask = torch.ones(3, LENGTH, dtype=torch.bool).tril(LENGTH - 3)[None, None]
    verify = _attend(q[:, :, -3:], k, v, verify_mask)
    # Row 0 of a batch: 7 columns of left padding and 5 "holes" (rejected drafts) before the last 3 queries.
    pad, holes = 7, 5
    width = pad + LENGTH + holes

    def spread(x):
        out = torch.randn(2, x.shape[1], width, DIM)
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
