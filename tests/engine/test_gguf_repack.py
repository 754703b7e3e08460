"""A GGUF's published Q4_K weights taken as they are by the w4a8 kernel (fly_llm.model.kernels.gguf_q4k).

`decode` is checked against gguf-py's own `dequantize`: bit for bit where the sub-block scales
d*sc and dmin*mn are exact in float16 (d, dmin powers of two), and otherwise within the float16
rounding of those two products: |decoded - gguf| <= 2^-11 * (15 * d * sc + dmin * mn) + 2^-24 * |w|.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file

from fly_llm.common.config import ModelSpec
from fly_llm.model.kernels import w4a8
from fly_llm.model.kernels.gguf_q4k import BLOCK_BYTES, SUPER_BLOCK, PublishedWeights, decode, save_published
from fly_llm.model.cache import MANIFEST, PUBLISHED, cache_problem, cached_conversion, published_weights, write_manifest
from fly_llm.model.pair import load_models
from fly_llm.model.quantization import W4A8Linear
from support.tiny_models import make_pair, write_tiny_gguf

needs_w4a8 = pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")
Q4_K = GGMLQuantizationType.Q4_K
SIZE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
# The tiny Llama's weights written as Q4_K (q/k in llama.cpp's permuted row order, as a real GGUF has them).
REPACKED = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj", "blk.0.attn_k.weight":
            "model.layers.0.self_attn.k_proj", "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj"}


def random_q4k(rows: int, k: int, seed: int, exact: bool = False) -> np.ndarray:
    """Random Q4_K rows (uint8 [rows, k/256*144]) with d, dmin in [2^-12, 2^-6] (powers of two if `exact`)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, k // SUPER_BLOCK, BLOCK_BYTES), dtype=np.uint8)
    for offset in (0, 2):  # d, then dmin
        scale = 2.0 ** rng.integers(-12, -6, size=blocks.shape[:2]) if exact else rng.uniform(2**-12, 2**-6,
                                                                                               blocks.shape[:2])
        blocks[..., offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def gguf_dequantize(blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(blocks, Q4_K))


def test_decode_is_gguf_dequantize_bit_for_bit_where_the_scales_are_exact():
    blocks = random_q4k(24, 512, seed=1, exact=True)
    weight = decode(torch.from_numpy(blocks))
    assert weight.q.shape == (24, 512) and weight.d.shape == weight.m.shape == (24, 2)
    assert weight.sc.shape == weight.mn.shape == (24, 16) and weight.sc.dtype == weight.mn.dtype == torch.uint8
    assert int(weight.q.max()) == 15 and weight.d.dtype == weight.m.dtype == torch.float16
    assert int(weight.sc.max()) == int(weight.mn.max()) == 63  # 6-bit multipliers, unpacked
    assert torch.equal(weight.dequantize(), gguf_dequantize(blocks))


def test_decode_rounds_only_the_scales():
    blocks = random_q4k(40, 768, seed=2)
    weight, expected = decode(torch.from_numpy(blocks)), gguf_dequantize(blocks)
    raw = blocks.reshape(40, -1, BLOCK_BYTES)
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)).float()  # per super-block
    dmin = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)).float()
    # the largest d*sc and dmin*mn of each super-block (6-bit sc, mn <= 63), per weight
    bound = 2**-11 * (15 * 63 * d + 63 * dmin).repeat_interleave(SUPER_BLOCK, dim=1).reshape(40, 768)
    error = (weight.dequantize() - expected).abs()
    assert torch.all(error <= bound + 2**-24 * expected.abs())
    assert error.max() > 0  # the products did need rounding: the check above is not vacuous


def test_decode_refuses_what_is_not_q4k_rows():
    with pytest.raises(ValueError, match="Q4_K rows"):
        decode(torch.zeros(4, 100, dtype=torch.uint8))


def test_saved_weights_decode_on_demand(tmp_path):
    blocks = {"a.proj": torch.from_numpy(random_q4k(8, 256, seed=3))}
    save_published(blocks, tmp_path / "p.safetensors")
    published = PublishedWeights(tmp_path / "p.safetensors")
    assert list(published) == ["a.proj"] and published.get("b.proj") is None
    assert torch.equal(published["a.proj"].q, decode(blocks["a.proj"]).q)
    (tmp_path / "other.safetensors").write_bytes((tmp_path / "p.safetensors").read_bytes().replace(b"gguf-q4_k",
                                                                                                   b"something"))
    with pytest.raises(ValueError, match="not a file of published"):
        PublishedWeights(tmp_path / "other.safetensors")


@pytest.fixture
def q4k_gguf(tmp_path):
    """A tiny Llama GGUF with three Linear weights in Q4_K (returns its path and their raw blocks)."""
    target, _, tokenizer = make_pair(device="cpu", **SIZE)
    shapes = {name: target.get_submodule(module).weight.shape for name, module in REPACKED.items()}
    raw = {name: random_q4k(rows, k, seed=i) for i, (name, (rows, k)) in enumerate(shapes.items())}
    return write_tiny_gguf(tmp_path / "q4k.gguf", target, tokenizer, {n: (b, Q4_K) for n, b in raw.items()}), raw


def test_published_rows_are_in_the_model_order_transformers_loads(q4k_gguf, tmp_path):
    path, raw = q4k_gguf
    built = cached_conversion(tmp_path / "cache", "tiny", lambda _: path, progress=False)
    published = published_weights(built)
    assert set(published) == set(REPACKED.values())
    floats = load_file(built / "model.safetensors")  # transformers' dequantized (and q/k un-permuted) weights
    for module in REPACKED.values():
        mine, theirs = published[module].dequantize(), floats[f"{module}.weight"].float()
        # theirs is rounded to bf16 (2^-9 relative) and mine has float16 sub-block scales: each weight within
        # 2^-8 of the tensor's largest; rows out of order would miss by about that largest itself
        assert (mine - theirs).abs().max() <= 2**-8 * theirs.abs().max(), module
    assert published_weights(tmp_path) is None  # not a model cache


@needs_w4a8
def test_w4a8_takes_the_published_blocks_and_rounds_the_rest(q4k_gguf, tmp_path, monkeypatch):
    path, _ = q4k_gguf
    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path / "cache"))
    spec = ModelSpec(target=str(path), draft="none", dtype="float32", device="cpu", target_quantization="w4a8")
    loaded = load_models(spec, progress=False)
    (built,) = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".") and p.name != "kernels"]
    published = published_weights(built)
    floats = load_models(ModelSpec(target=str(path), draft="none", dtype="float32", device="cpu",
                                   target_quantization="none"), progress=False).target
    for name, module in loaded.target.named_modules():
        if not isinstance(module, W4A8Linear):
            continue
        weight = published[name] if name in published else w4a8.quantize_weight(floats.get_submodule(name).weight)
        expected = w4a8.pack(weight)
        assert torch.equal(module.packed.q, expected.q), name
        assert torch.equal(module.packed.d, expected.d) and torch.equal(module.packed.m, expected.m)
        assert (module.packed.levels is not None) == (name in published)  # published: the two levels kept
        if name in published:
            assert all(torch.equal(getattr(module.packed.levels, f), getattr(expected.levels, f))
                       for f in ("d", "m", "sc", "mn"))
    assert len(published) == 3


def test_a_cache_from_before_gets_its_published_weights_added(q4k_gguf, tmp_path):
    path, _ = q4k_gguf
    root = tmp_path / "cache"
    built = cached_conversion(root, "tiny", lambda _: path, progress=False)
    (built / PUBLISHED).unlink()  # as a cache built before the published weights were kept
    write_manifest(built, json.loads((built / MANIFEST).read_text())["source"])
    assert published_weights(built) is None
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    again = cached_conversion(root, "tiny", lambda _: path, progress=False)
    assert again == built and cache_problem(built) is None
    assert len(published_weights(built)) == 3
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp  # the float weights were kept, not rebuilt
    with open(built / PUBLISHED, "r+b") as f:  # the manifest covers the published weights too
        f.seek(200)
        f.write(b"\xff" * 8)
    assert "changed" in cache_problem(built) and published_weights(built) is None


def test_a_manifest_left_half_written_is_not_listed_in_the_next(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"w" * 100)
    (tmp_path / f".{MANIFEST}.tmp").write_text("{")  # a crash between writing the manifest and renaming it
    write_manifest(tmp_path, {"key": "x"})
    assert cache_problem(tmp_path) is None
    assert list(json.loads((tmp_path / MANIFEST).read_text())["files"]) == ["weights.bin"]
