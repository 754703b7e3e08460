"""The native layer ops (fly_llm.model.kernels.layer_ops): each against its torch twin (transformers'
arithmetic), and a row's output the same bit for bit however many rows the call holds and at any
thread count.

Tolerances against torch: rotary (alone or with the cache write) and the residual add are bit-exact
(every rounding written out); RMSNorm's sum of squares and SiLU's exp are computed in another order /
by another polynomial, so in float32 they may differ in the last bits (rtol 2e-6), and in bfloat16
where that difference crosses a rounding boundary by one bf16 step, two for RMSNorm (its normed value
is rounded before the weight multiply, then the product): rtol 2^-6."""

from __future__ import annotations

import shutil

import pytest
import torch

from fly_llm.model.kernels import layer_ops

pytestmark = pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler here")
DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 7, 45]  # 45 rows of 1536: split over threads (a thread task holds ~21 rows)
HIDDEN, HEADS, KV_HEADS, DIM, FF = 1536, 12, 2, 128, 8960  # the embedded target's shapes


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Run a test at 1 and at 2 torch threads (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The stated tolerance: float32's last bits, or two bfloat16 steps."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    rtol = 2e-6 if out.dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(out, expected, rtol=rtol, atol=1e-6)


def _norm_inputs(rows: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=generator).to(dtype)
    residual = (4 * torch.randn(rows, HIDDEN, generator=generator)).to(dtype)
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=generator)).to(dtype)
    return x, residual, weight


def _rotary_inputs(batch: int, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(batch, tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=generator).to(dtype)
    angles = torch.rand(batch, tokens, DIM // 2, generator=generator) * 300
    angles = torch.cat((angles, angles), dim=-1)  # as transformers' rotary embedding builds them
    return qkv, angles.cos().to(dtype), angles.sin().to(dtype)


def test_the_ops_build_where_a_compiler_exists():
    assert layer_ops.available()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_norms_are_transformers_rms_norm(dtype, rows, threads):
    x, residual, weight = _norm_inputs(rows, dtype)
    _close(layer_ops.rms_norm(x, weight, 1e-6), layer_ops.reference_rms_norm(x, weight, 1e-6))
    total, normed = layer_ops.add_rms_norm(x, residual, weight, 1e-6)
    expected_total, expected_normed = layer_ops.reference_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, expected_total)
    _close(normed, expected_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (3, 5), (2, 16)])
def test_rotary_is_transformers_rotary_bit_for_bit(dtype, batch, tokens, threads):
    qkv, cos, sin = _rotary_inputs(batch, tokens, dtype)
    rotated = layer_ops.rotary_(qkv.clone(), cos, sin, HEADS + KV_HEADS, DIM)
    assert torch.equal(rotated, layer_ops.reference_rotary_(qkv.clone(), cos, sin, HEADS + KV_HEADS, DIM))
    assert torch.equal(rotated[..., (HEADS + KV_HEADS) * DIM:], qkv[..., (HEADS + KV_HEADS) * DIM:])  # v as it was
    shared = layer_ops.rotary_(qkv[:1].clone(), cos[:1], sin[:1], HEADS + KV_HEADS, DIM)  # cos [1, S, D]: broadcast
    assert torch.equal(shared, rotated[:1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (2, 16)])
def test_rotary_store_rotates_then_writes_k_and_v_into_the_cache_bit_for_bit(dtype, batch, tokens):
    qkv, cos, sin = _rotary_inputs(batch, tokens, dtype)
    buffers = [torch.randn(batch, KV_HEADS, 40, DIM).to(dtype) for _ in range(2)]
    expected = [b.clone() for b in buffers]
    rotated = layer_ops.rotary_store_(qkv.clone(), cos, sin, HEADS, KV_HEADS, DIM, *buffers, 7)
    assert torch.equal(rotated, layer_ops.rotary_(qkv.clone(), cos, sin, HEADS + KV_HEADS, DIM))
    _, key, value = rotated.view(batch, tokens, -1, DIM).transpose(1, 2).split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    expected[0][:, :, 7:7 + tokens], expected[1][:, :, 7:7 + tokens] = key, value  # the other columns untouched
    assert torch.equal(buffers[0], expected[0]) and torch.equal(buffers[1], expected[1])
    twins = [b.clone() for b in buffers]
    layer_ops.reference_rotary_store_(qkv.clone(), cos, sin, HEADS, KV_HEADS, DIM, *twins, 7)
    assert torch.equal(twins[0], expected[0]) and torch.equal(twins[1], expected[1])
    with pytest.raises(RuntimeError, match="do not fit a capacity"):
        layer_ops.rotary_store_(qkv.clone(), cos, sin, HEADS, KV_HEADS, DIM, *buffers, 41 - tokens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_is_silu_of_gate_times_up(dtype, rows, threads):
    gate_up = (3 * torch.randn(rows, 2 * FF, generator=torch.Generator().manual_seed(2))).to(dtype)
    _close(layer_ops.silu_mul(gate_up), layer_ops.reference_silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_output_does_not_depend_on_the_other_rows(dtype, threads):
    x, residual, weight = _norm_inputs(45, dtype)
    louder = x.clone()
    louder[7] *= 1000  # a loud neighbour changes nothing else
    gate_up = torch.cat((x, residual), dim=-1)
    qkv, cos, sin = _rotary_inputs(45, 1, dtype)
    batched = [layer_ops.rms_norm(x, weight, 1e-6), *layer_ops.add_rms_norm(x, residual, weight, 1e-6),
               layer_ops.silu_mul(gate_up), layer_ops.rotary_(qkv.clone(), cos, sin, HEADS, DIM)[:, 0]]
    for i in (0, 7, 44):
        alone = [layer_ops.rms_norm(x[i:i + 1], weight, 1e-6), *layer_ops.add_rms_norm(
                     x[i:i + 1], residual[i:i + 1], weight, 1e-6), layer_ops.silu_mul(gate_up[i:i + 1]),
                 layer_ops.rotary_(qkv[i:i + 1].clone(), cos[i:i + 1], sin[i:i + 1], HEADS, DIM)[:, 0]]
        for whole, one in zip(batched, alone):
            assert torch.equal(whole[i:i + 1], one)
    nine = layer_ops.rms_norm(louder[:9], weight, 1e-6)
    assert torch.equal(nine[:7], batched[0][:7]) and torch.equal(nine[8:], batched[0][8:9])


def test_other_dtypes_take_the_torch_twin():
    x, residual, weight = (t.half() for t in _norm_inputs(3, torch.float32))
    assert not layer_ops.native(x, weight)
    assert torch.equal(layer_ops.rms_norm(x, weight, 1e-6), layer_ops.reference_rms_norm(x, weight, 1e-6))
    assert not layer_ops.native(x.float(), weight)  # a weight of another dtype: torch promotes, so does the twin
    assert torch.equal(layer_ops.rms_norm(x.float(), weight, 1e-6),
                       layer_ops.reference_rms_norm(x.float(), weight, 1e-6))


def test_a_misshapen_call_is_refused_with_what_is_wrong():
    qkv, cos, sin = _rotary_inputs(1, 2, torch.float32)
    with pytest.raises(RuntimeError, match="do not fit a row"):
        layer_ops.rotary_(qkv, cos, sin, HEADS + 2 * KV_HEADS + 1, DIM)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        layer_ops.rotary_(qkv, cos[..., :DIM // 2], sin[..., :DIM // 2], HEADS, DIM)
