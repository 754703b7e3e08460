"""The W4A8 CPU kernel (fly_llm.model.kernels.w4a8) and the `w4a8` quantization built on it.

The kernel is checked against `reference_linear`, the same quantized math in float64 torch, within
|kernel - reference| <= 1e-5 * (|x̂| @ |Ŵ|^T) + 1e-7, x̂ and Ŵ the quantized activations and weights:
float32 rounding of two products per block of 32, accumulated over at most 8 blocks here.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import shutil

import pytest
import torch
from transformers import DynamicCache

from fly_llm.model import quantization
from fly_llm.common.config import ModelSpec
from fly_llm.model.kernels import w4a8
from fly_llm.model.pair import load_models
from fly_llm.model.quantization import quantize, resolve_quantization
from fly_llm.model.w4a8_layers import W4A8Linear

CPU = torch.device("cpu")
CAN_BUILD = platform.machine().lower() in {"x86_64", "amd64"} and bool(shutil.which("c++") or shutil.which("g++"))
has_vnni = pytest.mark.skipif(not (CAN_BUILD and w4a8.best_isa() == "avx512_vnni"), reason="no AVX-512 VNNI here")
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="the kernel needs an x86 CPU and a C++ compiler")
ISAS = [pytest.param("avx512_vnni", marks=has_vnni), "avx2"]
ISAS_HERE = ["avx2", "avx512_vnni"] if CAN_BUILD and w4a8.best_isa() == "avx512_vnni" else ["avx2"]


@pytest.fixture
def threads():
    """Set torch's thread count for one test, restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _weight(n: int, k: int, seed: int = 0) -> tuple[w4a8.QuantizedWeight, torch.Tensor]:
    torch.manual_seed(seed)
    return w4a8.quantize_weight(torch.randn(n, k) * 0.05 + 0.01), torch.randn(n)


def _bound(x: torch.Tensor, weight: w4a8.QuantizedWeight) -> torch.Tensor:
    """1e-5 * (|x̂| @ |Ŵ|^T) + 1e-7: the tolerance stated in the module docstring."""
    magnitude = w4a8.QuantizedWeight(weight.q, weight.d.abs(), -weight.m.abs())
    return 1e-5 * w4a8.reference_linear(x.abs(), magnitude) + 1e-7


def test_the_kernel_builds_where_a_compiler_exists():
    assert w4a8.available() and w4a8.best_isa() in ("avx512_vnni", "avx2")


def test_quantized_weights_are_close_to_float():
    torch.manual_seed(1)
    weight = torch.randn(40, 96)
    quantized = w4a8.quantize_weight(weight)
    assert quantized.q.max() <= 15
    assert ((quantized.dequantize() - weight).norm() / weight.norm()).item() < 0.1


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(47, 224), (1, 32), (64, 96)])  # N tails and an odd number of K blocks
def test_kernel_matches_the_reference_for_every_row_count(isa, n_threads, n, k, threads):
    threads(n_threads)
    weight, bias = _weight(n, k)
    packed = w4a8.pack(weight)
    torch.manual_seed(2)
    for rows in range(1, 34):
        x = torch.randn(rows, k)
        out = w4a8.linear(x, packed, bias, isa=isa)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        error = (out.double() - w4a8.reference_linear(x, weight, bias)).abs()
        assert (error <= _bound(x, weight)).all(), f"{rows} rows: max error {error.max().item():.3g}"


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_output_is_the_same_in_any_batch_bit_for_bit(isa, threads):
    """Row r alone, at any position of 17 rows, of 70 rows (three panels), and with 1 or 2 threads."""
    weight, bias = _weight(33, 160)
    packed = w4a8.pack(weight)
    torch.manual_seed(3)
    x = torch.randn(70, 160)
    x[5] *= 1000  # one loud neighbour changes no other row
    threads(2)
    alone = torch.cat([w4a8.linear(x[r:r + 1], packed, bias, isa=isa) for r in range(70)])
    assert torch.equal(w4a8.linear(x, packed, bias, isa=isa), alone)
    for start in (0, 6, 53):
        assert torch.equal(w4a8.linear(x[start:start + 17], packed, bias, isa=isa), alone[start:start + 17])
    threads(1)
    assert torch.equal(w4a8.linear(x[:17], packed, bias, isa=isa), alone[:17])


@has_vnni
def test_the_avx2_and_vnni_paths_agree_bit_for_bit(monkeypatch):
    weight, bias = _weight(50, 256)
    packed = w4a8.pack(weight)
    x = torch.randn(9, 256)
    vnni = w4a8.linear(x, packed, bias, isa="avx512_vnni")
    monkeypatch.setenv(w4a8.ISA_ENV, "avx2")  # the variable forces the path when no argument does
    assert torch.equal(w4a8.linear(x, packed, bias), vnni)
    assert torch.equal(w4a8.linear(x, packed, bias, isa="avx2"), vnni)


@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_in_and_out_is_the_float32_result_rounded(isa):
    weight, bias = _weight(40, 128)
    packed = w4a8.pack(weight)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    out = w4a8.linear(x, packed, bias, isa=isa)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, w4a8.linear(x.float(), packed, bias, isa=isa).bfloat16())


def test_widths_that_are_not_whole_blocks_are_rejected_clearly():
    with pytest.raises(ValueError, match="multiple of 32"):
        w4a8.quantize_weight(torch.randn(16, 48))
    packed = w4a8.pack(_weight(16, 64)[0])
    with pytest.raises(RuntimeError, match="does not match"):
        w4a8.linear(torch.randn(2, 96), packed)
    with pytest.raises(ValueError, match="unknown w4a8 instruction set"):
        w4a8.linear(torch.randn(2, 64), packed, isa="sse2")
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8))
    assert quantize(model, "w4a8", CPU) == "w4a8"
    assert isinstance(model[0], W4A8Linear) and type(model[1]) is torch.nn.Linear


def test_the_layer_keeps_shape_and_dtype_and_is_close_to_float():
    torch.manual_seed(4)
    linear = torch.nn.Linear(128, 96)
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    out = W4A8Linear(linear)(x)
    reference = linear(x.float())
    assert out.shape == (3, 5, 96) and out.dtype == torch.bfloat16
    assert ((out.float() - reference).norm() / reference.norm()).item() < 0.15


def test_without_the_kernel_w4a8_falls_back_to_int8_with_a_log_line(monkeypatch, caplog):
    monkeypatch.setitem(quantization._AVAILABLE, "w4a8", lambda: False)
    monkeypatch.setitem(quantization._AVAILABLE, "int8", lambda: True)
    with caplog.at_level(logging.WARNING, logger="fly_llm.model.quantization"):
        assert resolve_quantization("w4a8", CPU, "draft") == "int8"
    assert "draft_quantization='w4a8'" in caplog.text and "using int8" in caplog.text


def test_a_w4a8_target_scores_a_token_the_same_however_it_is_scheduled(tiny_pair_dirs):
    """Bit for bit: one full forward vs a prefill and a 3-token verify vs 1-token decode steps."""
    loaded = load_models(ModelSpec(target=str(tiny_pair_dirs[0]), draft="none", dtype="float32", device="cpu",
                                   target_quantization="w4a8"), progress=False)
    target, ids = loaded.target, loaded.tokenizer.encode("the quick brown fox jumps over " * 4)
    with torch.inference_mode():
        full = target(torch.tensor([ids])).logits[0, -3:]
        cache = DynamicCache(config=target.config)
        target(torch.tensor([ids[:-3]]), past_key_values=cache, use_cache=True)
        verify = target(torch.tensor([ids[-3:]]), past_key_values=cache, use_cache=True).logits[0]
        cache = DynamicCache(config=target.config)
        target(torch.tensor([ids[:-3]]), past_key_values=cache, use_cache=True)
        steps = torch.cat([target(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0]
                           for t in ids[-3:]])
    assert torch.equal(verify, full) and torch.equal(steps, full)



def _same_in_any_batch(packed: w4a8.Packed, bias: torch.Tensor, x: torch.Tensor, set_threads) -> torch.Tensor:
    """Each row of x (row 5 loud) gives the same output alone on the AVX2 path as in the whole batch or a slice of
    it, on every path here, at 2 and 1 threads, and a bfloat16 x the float32 output rounded; returns the rows'
    outputs alone."""
    assert x[5].abs().max() > 100 * x[6:].abs().max()  # one loud neighbour changes no other row
    set_threads(2)
    alone = torch.cat([w4a8.linear(x[r:r + 1], packed, bias, isa="avx2") for r in range(len(x))])
    for isa in ISAS_HERE:
        assert torch.equal(w4a8.linear(x, packed, bias, isa=isa), alone), isa
        assert torch.equal(w4a8.linear(x[6:23], packed, bias, isa=isa), alone[6:23]), isa
    set_threads(1)
    assert torch.equal(w4a8.linear(x[:17], packed, bias, isa=ISAS_HERE[-1]), alone[:17])
    bf16 = x[:9].bfloat16()
    assert torch.equal(w4a8.linear(bf16, packed, bias), w4a8.linear(bf16.float(), packed, bias).bfloat16())
    return alone


def _two_level(n: int, k: int, seed: int, bits: int = 0) -> w4a8.SuperBlockWeight:
    """A random weight in GGUF Q4_K's (bits 0) or Q5_K's (bits 1) two levels (6-bit multipliers, float16 d and
    m per 256 weights)."""
    generator = torch.Generator().manual_seed(seed)
    supers, blocks = k // (w4a8.SUPER * w4a8.BLOCK), k // w4a8.BLOCK
    return w4a8.SuperBlockWeight(
        torch.randint(0, 16 << bits, (n, k), dtype=torch.uint8, generator=generator),
        (torch.rand(n, supers, generator=generator) * 2**-6).half(),  # products far from exact in float16
        (torch.rand(n, supers, generator=generator) * 2**-6).half(),
        torch.randint(0, 64, (n, blocks), dtype=torch.uint8, generator=generator),
        torch.randint(0, 64, (n, blocks), dtype=torch.uint8, generator=generator), bits)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(47, 512), (16, 256), (3, 768)])
@pytest.mark.parametrize("bits", [0, 1], ids=["Q4_K", "Q5_K"])
def test_two_level_scales_give_the_one_level_output_bit_for_bit(isa, n_threads, n, k, bits, threads):
    """Every row count (the kernel rebuilds the float32 d and m from the two levels), both dtypes, the same
    output as float32 d and m per block, and the reference within its tolerance; 4- and 5-bit levels."""
    threads(n_threads)
    weight = _two_level(n, k, seed=n + k, bits=bits)
    packed, plain = w4a8.pack(weight), w4a8.pack(weight.per_block())
    assert packed.levels is not None and packed.d is None and plain.levels is None
    assert (packed.planes is not None) == (plain.planes is not None) == bool(bits)
    assert int(weight.q.max()) == (16 << bits) - 1  # every bit used
    assert plain.d.dtype == torch.float32 and packed.streamed_bytes() < plain.streamed_bytes()
    assert torch.equal(packed.one_level().d, plain.d) and torch.equal(packed.one_level().m, plain.m)
    bias = torch.randn(n)
    torch.manual_seed(5)
    for rows in range(1, 34):
        x = torch.randn(rows, k)
        out = w4a8.linear(x, packed, bias, isa=isa)
        assert torch.equal(out, w4a8.linear(x, plain, bias, isa=isa)), f"{rows} rows"
        error = (out.double() - w4a8.reference_linear(x, weight, bias)).abs()
        assert (error <= _bound(x, weight.per_block())).all(), f"{rows} rows: max error {error.max().item():.3g}"
    x = torch.randn(3, k, dtype=torch.bfloat16)
    assert torch.equal(w4a8.linear(x, packed, bias, isa=isa), w4a8.linear(x, plain, bias, isa=isa))


@pytest.mark.parametrize("isa", ISAS)
def test_the_rebuilt_scales_are_the_exact_products_as_ggml_computes_them(isa):
    """d * sc in float32, not rounded again to float16 (as ggml's dequantization): 1.5 * 2^-10 * 3 and
    (1 + 2^-10) * 63 are not float16 values, 2^-14 * 63 is subnormal there. The kernel computes with them too:
    its output for a weight of such blocks is the reference's on the float32 products, not on their float16
    roundings."""
    top = torch.tensor([[1.5 * 2**-10, 2**-14, 1 + 2**-10]]).half()
    sub = torch.tensor([[3] * 8 + [63] * 8 + [63] * 8], dtype=torch.uint8)
    weight = w4a8.SuperBlockWeight(torch.full((1, 768), 15, dtype=torch.uint8), top, top, sub, sub)
    expected = top.double().repeat_interleave(8, dim=1) * sub.double()
    assert torch.equal(weight.per_block().d.double(), expected) and torch.equal(weight.per_block().m.double(), expected)
    assert not torch.equal(expected.half().double(), expected)  # a float16 rounding would change them
    x = torch.ones(1, 768)  # w = 15 d - d: the output is 14 * 32 * the sum of the blocks' d
    exact = w4a8.reference_linear(x, weight)
    rounded = w4a8.reference_linear(x, w4a8.QuantizedWeight(weight.q, expected.half(), expected.half()))
    out = w4a8.linear(x, w4a8.pack(weight), isa=isa).double()
    assert (out - exact).abs().item() < (out - rounded).abs().item()


@pytest.mark.parametrize("form", ["two levels", "float16 d and m"])
def test_five_bit_levels_give_a_row_the_same_output_in_any_batch_and_on_both_paths(form, threads):
    """Q5_K's (two levels) and Q5_1's (float16 d and m) fifth bits: a row's output is the same alone or in any
    batch, on both paths, and is the reference's within its tolerance."""
    weight = _two_level(33, 512, seed=9, bits=1)
    if form != "two levels":
        weight = w4a8.QuantizedWeight(weight.q, weight.per_block().d.half(), weight.per_block().m.half(), bits=1)
    torch.manual_seed(10)
    bias, x = torch.randn(33), torch.randn(70, 512)
    x[5] *= 1000
    alone = _same_in_any_batch(w4a8.pack(weight), bias, x, threads)
    reference = w4a8.reference_linear(x, weight, bias)
    plain = weight.per_block() if form == "two levels" else weight
    assert ((alone.double() - reference).abs() <= _bound(x, plain)).all()


def test_every_five_bit_level_packs_and_decodes_back():
    """A one-hot input picks one weight out per column: every level 0..31 at every position of a block."""
    levels = torch.arange(32, dtype=torch.uint8)
    q = torch.stack([levels.roll(col) for col in range(32)]).repeat(1, 8)  # [32, 256]
    ones = torch.ones(32, 8, dtype=torch.float16)
    for weight in (w4a8.QuantizedWeight(q, ones, torch.zeros_like(ones), bits=1),
                   w4a8.SuperBlockWeight(q, ones[:, :1], ones[:, :1], torch.ones(32, 8, dtype=torch.uint8),
                                         torch.zeros(32, 8, dtype=torch.uint8), bits=1)):
        packed = w4a8.pack(weight)
        for isa in ISAS_HERE:
            for i in range(0, 256, 7):
                x = torch.zeros(1, 256)
                x[0, i] = 1.0
                assert torch.equal(w4a8.linear(x, packed, isa=isa)[0], q[:, i].float()), (type(weight), isa, i)


def test_fused_weights_keep_two_levels_only_where_every_part_has_them():
    two, other = w4a8.pack(_two_level(32, 256, seed=1)), w4a8.pack(_two_level(16, 256, seed=2))
    both = w4a8.concat([two, other])
    assert both.levels is not None and both.n == 48
    mixed = w4a8.concat([two, other.one_level()])  # scales of two forms: the parts side by side
    assert isinstance(mixed, w4a8.PackedParts) and [p.levels is not None for p in mixed.parts] == [True, False]
    x = torch.randn(2, 256)
    assert torch.equal(w4a8.linear(x, both), torch.cat([w4a8.linear(x, two), w4a8.linear(x, other)], dim=1))
    assert torch.equal(w4a8.linear(x, mixed), w4a8.linear(x, both))
    five, five_more = w4a8.pack(_two_level(16, 256, seed=4, bits=1)), w4a8.pack(_two_level(16, 256, seed=5, bits=1))
    with_fifth = w4a8.concat([two, five, five_more])  # the fifth bits: not joined with 4-bit levels
    assert isinstance(with_fifth, w4a8.PackedParts) and [p.planes is not None for p in with_fifth.parts] == [False, True]
    assert with_fifth.parts[1].n == 32 and with_fifth.parts[1].planes.shape[0] == 2
    expected = torch.cat([w4a8.linear(x, p) for p in (two, five, five_more)], dim=1)
    assert torch.equal(w4a8.linear(x, with_fifth), expected)


def test_two_level_scales_of_the_wrong_shape_are_refused():
    packed = w4a8.pack(_two_level(16, 256, seed=3))
    levels = packed.levels
    short = w4a8.TwoLevelScales(levels.d[:, :0], levels.m[:, :0], levels.sc, levels.mn)
    with pytest.raises(RuntimeError, match="top_d and top_m"):
        w4a8.linear(torch.randn(1, 256), w4a8.PackedWeight(packed.q, None, None, 16, short))
    wide = w4a8.TwoLevelScales(levels.d, levels.m, levels.sc.half(), levels.mn)
    with pytest.raises(RuntimeError, match="sc and mn"):
        w4a8.linear(torch.randn(1, 256), w4a8.PackedWeight(packed.q, None, None, 16, wide))
    plain = packed.one_level()
    with pytest.raises(ValueError, match="not both"):
        w4a8.PackedWeight(packed.q, plain.d, plain.m, 16, levels)
    with pytest.raises(RuntimeError, match="both float16 or both"):
        w4a8.linear(torch.randn(1, 256), w4a8.PackedWeight(packed.q, plain.d, plain.m.half(), 16))
    five = w4a8.pack(_two_level(16, 256, seed=6, bits=1))
    with pytest.raises(RuntimeError, match="fifth bits"):
        w4a8.linear(torch.randn(1, 256), dataclasses.replace(five, planes=five.planes[:, :4]))
    with pytest.raises(ValueError, match="4 or 5 bits"):
        w4a8.pack(dataclasses.replace(_two_level(16, 256, seed=6), bits=2))
    with pytest.raises(ValueError, match="does not fit 4 bits"):  # a fifth bit would be dropped, not packed
        w4a8.pack(dataclasses.replace(_two_level(16, 256, seed=6, bits=1), bits=0))


def test_published_weights_are_taken_as_they_are_not_rounded_again():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32, bias=False))
    published = w4a8.quantize_weight(torch.randn(32, 64))  # not a rounding of model[1]'s float weight
    rounded = w4a8.pack(w4a8.quantize_weight(model[0].weight))
    quantize(model, "w4a8", CPU, "draft", published={"1": published})
    for field in ("q", "d", "m"):
        assert torch.equal(getattr(model[1].packed, field), getattr(w4a8.pack(published), field))
        assert torch.equal(getattr(model[0].packed, field), getattr(rounded, field))
    with pytest.raises(ValueError, match="published weight of shape"):
        W4A8Linear(torch.nn.Linear(64, 16), published)


# Symmetric blocks (GGUF's Q4_0, Q5_0, Q8_0, Q6_K as published): (bits, zero, span, sub-scales).
SYMMETRIC = {"Q4_0": (0, 8, 1, False), "Q5_0": (1, 16, 1, False), "Q8_0": (4, 128, 1, False),
             "Q6_K": (2, 32, 8, True), "2 bits, span 1": (2, 32, 1, True), "8 bits, span 8": (4, 128, 8, True)}


def _symmetric(n: int, k: int, layout: tuple[int, int, int, bool], seed: int = 0) -> w4a8.SymmetricWeight:
    bits, zero, span, sub = layout
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16 << bits, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    d = (torch.rand(n, k // (span * w4a8.BLOCK), generator=g) * 0.01 + 0.001).half()
    sc = torch.randint(-128, 128, (n, k // w4a8.HALF), generator=g, dtype=torch.int32).to(torch.int8) if sub else None
    return w4a8.SymmetricWeight(q, d, sc, bits, zero, span)


def _symmetric_bound(x: torch.Tensor, weight: w4a8.SymmetricWeight) -> torch.Tensor:
    """1e-5 * (|x̂| @ |Ŵ|^T) + 1e-7, as for the 4-bit weights: float32 rounding of one product per block."""
    q, scale = w4a8.quantize_activations(x)
    x_hat = (q.double().reshape(*q.shape[:-1], -1, w4a8.BLOCK) * scale.double()[..., None]).reshape(q.shape)
    return 1e-5 * (x_hat.abs() @ weight.dequantize().abs().T) + 1e-7


WHOLE = [pytest.param(False, id="nibbles"), pytest.param(True, id="whole")]


def _packed(weight: w4a8.SymmetricWeight, whole: bool) -> w4a8.PackedSymmetric:
    """`weight` packed as nibbles and planes or as whole bytes (8-bit levels: whole bytes only)."""
    if weight.bits == 4 and not whole:
        pytest.skip("8-bit levels are packed as whole bytes only")
    return w4a8.pack_symmetric(weight, whole)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("whole", WHOLE)
@pytest.mark.parametrize("layout", list(SYMMETRIC.values()), ids=list(SYMMETRIC))
def test_symmetric_blocks_match_the_reference_for_every_row_count(isa, n_threads, whole, layout, threads):
    threads(n_threads)
    for n, k in [(47, 256), (5, 768)]:  # an N tail, and three spans of 8 blocks
        weight = _symmetric(n, k, layout)
        packed, bias = _packed(weight, whole), torch.randn(n)
        for rows in (1, 2, 3, 4, 5, 8, 9, 17, 33):
            x = torch.randn(rows, k)
            out = w4a8.linear(x, packed, bias, isa=isa)
            assert out.shape == (rows, n) and out.dtype == torch.float32
            error = (out.double() - w4a8.reference_linear(x, weight, bias)).abs()
            assert (error <= _symmetric_bound(x, weight)).all(), f"{rows} rows: max error {error.max().item():.3g}"


@pytest.mark.parametrize("whole", WHOLE)
@pytest.mark.parametrize("layout", list(SYMMETRIC.values()), ids=list(SYMMETRIC))
def test_symmetric_blocks_give_a_row_the_same_output_in_any_batch_and_on_both_paths(whole, layout, threads):
    weight = _symmetric(33, 256, layout, seed=5)
    torch.manual_seed(6)
    x = torch.randn(70, 256)
    x[5] *= 1000
    _same_in_any_batch(_packed(weight, whole), torch.randn(33), x, threads)


def test_whole_bytes_are_the_nibbles_output_bit_for_bit():
    """The two layouts of one weight: the same integer sums and float steps, so the same bits."""
    for name in ("Q4_0", "Q5_0", "Q6_K"):
        weight = _symmetric(40, 512, SYMMETRIC[name], seed=7)
        x = torch.randn(9, 512)
        assert torch.equal(w4a8.linear(x, w4a8.pack_symmetric(weight, True)),
                           w4a8.linear(x, w4a8.pack_symmetric(weight, False))), name


@pytest.mark.parametrize("whole", WHOLE)
def test_the_bit_planes_hold_every_level(whole):
    """Every level of every layout packs and decodes back: a one-hot input picks one weight out per column."""
    for bits, zero, span, _ in SYMMETRIC.values():
        if bits == 4 and not whole:
            continue
        levels = torch.arange(16 << bits, dtype=torch.int32).remainder(16 << bits).to(torch.uint8)
        q = levels.repeat((256 * 32) // levels.numel() + 1)[:256 * 32].reshape(32, 256)
        weight = w4a8.SymmetricWeight(q, torch.ones(32, 256 // (span * 32), dtype=torch.float16), None, bits, zero,
                                      span)
        packed = w4a8.pack_symmetric(weight, whole)
        for i in (0, 5, 16, 31, 200):
            x = torch.zeros(1, 256)
            x[0, i] = 1.0
            assert torch.equal(w4a8.linear(x, packed)[0], q[:, i].float() - zero), (bits, i)


def test_layouts_side_by_side_are_each_parts_output():
    four = w4a8.quantize_weight(torch.randn(32, 256))
    six, eight = _symmetric(16, 256, SYMMETRIC["Q6_K"], 1), _symmetric(8, 256, SYMMETRIC["Q8_0"], 2)
    parts = [w4a8.pack(four), w4a8.pack_symmetric(six), w4a8.pack_symmetric(eight)]
    fused = w4a8.concat(parts)
    assert isinstance(fused, w4a8.PackedParts) and fused.n == 56 and len(fused.parts) == 3
    x, bias = torch.randn(3, 256), torch.randn(56)
    expected = torch.cat([w4a8.linear(x, p, b) for p, b in zip(parts, bias.split([32, 16, 8]))], dim=1)
    assert torch.equal(w4a8.linear(x, fused, bias), expected)
    same = w4a8.concat([w4a8.pack_symmetric(six), w4a8.pack_symmetric(_symmetric(16, 256, SYMMETRIC["Q6_K"], 3))])
    assert isinstance(same, w4a8.PackedSymmetric) and same.n == 32  # one layout: one weight


def test_symmetric_weights_of_the_wrong_shape_are_refused():
    packed = w4a8.pack_symmetric(_symmetric(16, 256, SYMMETRIC["Q6_K"]), whole=False)
    with pytest.raises(ValueError, match="whole spans"):
        w4a8.pack_symmetric(w4a8.SymmetricWeight(torch.zeros(16, 96, dtype=torch.uint8),
                                                 torch.zeros(16, 1, dtype=torch.float16), None, 2, 32, 8))
    with pytest.raises(ValueError, match="power of two"):  # the kernel finds a block's d by a shift
        w4a8.pack_symmetric(w4a8.SymmetricWeight(torch.zeros(16, 96, dtype=torch.uint8),
                                                 torch.zeros(16, 1, dtype=torch.float16), None, 2, 32, 3))
    with pytest.raises(ValueError, match="int8s"):  # whole bytes less the offset are int8s
        w4a8.pack_symmetric(_symmetric(16, 256, (4, 100, 1, False)))
    with pytest.raises(ValueError, match="whole bytes"):
        w4a8.pack_symmetric(_symmetric(16, 256, SYMMETRIC["Q8_0"]), whole=False)
    whole = w4a8.pack_symmetric(_symmetric(16, 256, SYMMETRIC["Q8_0"]))
    assert whole.lo.shape == (1, 8, 4, 128) and whole.planes.numel() == 0 and whole.weight_count() == 16 * 256
    for change, message in [({"zero": 100}, "int8s"), ({"lo": whole.lo[..., :64].contiguous()}, "4, 128"),
                            ({"planes": torch.zeros(64, dtype=torch.uint8)}, "planes")]:
        with pytest.raises(RuntimeError, match=message):
            w4a8.linear(torch.randn(1, 256), dataclasses.replace(whole, **change))
    for change, message in [({"bits": 3}, "high bits"), ({"zero": 64}, "offset"), ({"span": 3}, "spans"),
                            ({"planes": packed.planes[:, :4]}, "planes"), ({"d": packed.d.float()}, "float16")]:
        wrong = dataclasses.replace(packed, **change)
        with pytest.raises(RuntimeError, match=message):
            w4a8.linear(torch.randn(1, 256), wrong)
