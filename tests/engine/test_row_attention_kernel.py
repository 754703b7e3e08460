"""The C++ row attention op (fly_llm.model.kernels.row_attention): ordinary masked attention to float32
rounding, and a query's output the same bit for bit however the call around it is shaped (q
length, batch, padding, holes, thread count), on each instruction-set path."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from fly_llm.model import attention
from fly_llm.model.kernels import row_attention as native

CAN_BUILD = platform.machine().lower() in {"x86_64", "amd64"} and bool(shutil.which("c++") or shutil.which("g++"))
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="the op needs an x86 CPU and a C++ compiler")
has_avx512 = pytest.mark.skipif(not (CAN_BUILD and native.path(128) == "avx512"), reason="no AVX-512 here")
PATHS = [pytest.param(True, marks=has_avx512, id="avx512"), pytest.param(False, id="avx2")]
HEADS, KV_HEADS, DIM = 12, 2, 128  # the embedded target's attention shape


@pytest.fixture
def threads():
    """Set torch's thread count for one test, restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _inputs(batch, q, kv, dtype, heads=HEADS, kv_heads=KV_HEADS, dim=DIM, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(batch, heads, q, dim, dtype=dtype), torch.randn(batch, kv_heads, kv, dim, dtype=dtype),
            torch.randn(batch, kv_heads, kv, dim, dtype=dtype))


def _sdpa(q, k, v, mask):
    """Float64 SDPA with the mask [B, q, kv]; a query that sees nothing gives zeros."""
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask[:, None],
                                         enable_gqa=True).transpose(1, 2)
    return torch.where(mask.any(-1)[..., None, None], out, torch.zeros_like(out))


def _holes_mask(batch, q, kv):
    """Causal, with left padding in row 1, holes (rejected drafts) in row 0 and a padding query in row 1."""
    mask = torch.ones(batch, q, kv, dtype=torch.bool).tril(kv - q)
    mask[0, :, kv - q - 6:kv - q - 2] = False
    mask[1, :, :5] = False
    mask[1, 0] = False
    return mask


def test_the_op_builds_where_a_compiler_exists():
    assert native.available() and native.path(DIM) in ("avx512", "avx2")
    assert native.path(72) == "avx2"  # a head size that is not a multiple of 16 takes the AVX2 path


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "q", "kv", "dim"),
                         [(HEADS, KV_HEADS, 1, 300, DIM), (HEADS, KV_HEADS, 9, 300, DIM), (14, 2, 130, 400, 64),
                          (4, 4, 5, 37, 72), (HEADS, KV_HEADS, 4, 1100, DIM)])  # the last: five column blocks
def test_it_is_masked_attention(avx512, dtype, heads, kv_heads, q, kv, dim):
    query, key, value = _inputs(2, q, kv, dtype, heads, kv_heads, dim)
    mask = _holes_mask(2, q, kv)
    out = native.attention(query, key, value, mask, dim ** -0.5, avx512)
    assert out.shape == (2, q, heads, dim) and out.dtype == dtype
    expected = _sdpa(query, key, value, mask)
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2  # float32 rounding; a bf16 output's last bit
    assert (out.double() - expected).abs().max().item() <= tolerance
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))  # the padding query
    causal = native.attention(query, key, value, None, dim ** -0.5, avx512)
    assert torch.equal(causal, native.attention(query, key, value, torch.ones(2, q, kv, dtype=torch.bool)
                                                .tril(kv - q), dim ** -0.5, avx512))


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_however_the_call_is_shaped(avx512, dtype, threads):
    """The last query of a 130-token prefill, alone, at the end of a 9-token verify, and in row 0 of a
    3-row batch with left padding and holes before it, with 1 and 2 threads."""
    length = 130
    q, k, v = _inputs(1, length, length, dtype)
    threads(2)
    prefill = native.attention(q, k, v, None, DIM ** -0.5, avx512)
    pad, holes, width = 7, 5, 7 + length + 5

    def spread(x, seed):
        out = torch.randn(3, x.shape[1], width, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)
        out[0, :, pad:pad + length - 9] = x[0, :, :length - 9]
        out[0, :, width - 9:] = x[0, :, length - 9:]
        return out

    keep = torch.zeros(width, dtype=torch.bool)
    keep[pad:pad + length - 9] = keep[width - 9:] = True
    mask = torch.ones(3, 9, width, dtype=torch.bool).tril(width - 9)
    mask[0] &= keep
    mask[2, :, :20] = False
    for n_threads in (1, 2):
        threads(n_threads)
        alone = native.attention(q[:, :, -1:], k, v, None, DIM ** -0.5, avx512)
        verify = native.attention(q[:, :, -9:], k, v, None, DIM ** -0.5, avx512)
        ragged = native.attention(spread(q, 1)[:, :, -9:], spread(k, 2), spread(v, 3), mask, DIM ** -0.5, avx512)
        assert torch.equal(alone[0, 0], prefill[0, -1])
        assert torch.equal(verify[0], prefill[0, -9:])
        assert torch.equal(ragged[0], prefill[0, -9:])


def test_row_attention_uses_the_op_and_falls_back_to_the_torch_loop(monkeypatch):
    query, key, value = _inputs(2, 9, 40, torch.bfloat16)
    mask = _holes_mask(2, 9, 40)[:, None]
    out = attention.row_attention(None, query, key, value, mask, scaling=DIM ** -0.5)[0]
    assert torch.equal(out, native.attention(query, key, value, mask[:, 0], DIM ** -0.5))
    monkeypatch.setattr(native, "available", lambda: False)
    fallback = attention.row_attention(None, query, key, value, mask, scaling=DIM ** -0.5)[0]
    assert torch.equal(fallback, attention.reference_row_attention(None, query, key, value, mask,
                                                                   scaling=DIM ** -0.5)[0])
    assert (fallback.double() - out.double()).abs().max().item() <= 1e-2


def test_bad_inputs_are_clear_errors():
    query, key, value = _inputs(1, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match="all be float32 or all bfloat16"):
        native.attention(query, key.bfloat16(), value, None, 1.0)
    with pytest.raises(RuntimeError, match="boolean"):
        native.attention(query, key, value, torch.ones(1, 2, 7, dtype=torch.bool), 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        native.attention(query[:, :5], key, value, None, 1.0)
