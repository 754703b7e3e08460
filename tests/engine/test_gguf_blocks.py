"""A GGUF's published Linear weights taken as they are by the w4a8 kernel (fly_llm.model.kernels.gguf_blocks).

Each decoder is checked against gguf-py's own `dequantize`: every block type (Q4_K, Q6_K, Q8_0, Q5_0 and
Q4_0) decodes to exactly gguf-py's values, bit for bit (Q4_K's sub-block scales d*sc and dmin*mn are float32
products, as gguf-py and llama.cpp compute them).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file

from fly_llm.common.config import ModelSpec
from fly_llm.model.kernels import w4a8
from fly_llm.model.kernels.gguf_blocks import (DECODERS, PublishedWeights, decode, decode_q4_k, published_blocks,
                                               save_published)
from fly_llm.model.cache import MANIFEST, PUBLISHED, cache_problem, cached_conversion, published_weights, write_manifest
from fly_llm.model.pair import load_models
from fly_llm.model.w4a8_layers import W4A8Linear
from support.tiny_models import make_pair, write_tiny_gguf

needs_w4a8 = pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")
T = GGMLQuantizationType
Q4_K = T.Q4_K
SIZE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
# The tiny Llama's weights written in GGUF block types (q/k in llama.cpp's permuted row order, as a real GGUF
# has them): every type the kernel reads, one Linear each.
REPACKED = {"blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj", T.Q4_K),
            "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj", T.Q8_0),
            "blk.0.attn_v.weight": ("model.layers.0.self_attn.v_proj", T.Q5_0),
            "blk.1.attn_output.weight": ("model.layers.1.self_attn.o_proj", T.Q4_0),
            "blk.1.ffn_down.weight": ("model.layers.1.mlp.down_proj", T.Q6_K)}
# Per block type: (weights, bytes) of a block and the byte offsets of its float16 scales.
LAYOUT = {T.Q4_K: (256, 144, (0, 2)), T.Q6_K: (256, 210, (208,)), T.Q8_0: (32, 34, (0,)), T.Q5_0: (32, 22, (0,)),
          T.Q4_0: (32, 18, (0,)), T.Q4_1: (32, 20, (0, 2))}


def random_blocks(kind: GGMLQuantizationType, rows: int, k: int, seed: int, exact: bool = False) -> np.ndarray:
    """Random rows of `kind` (uint8 [rows, k/weights*bytes]) with float16 scales in [2^-12, 2^-6] (powers of
    two if `exact`)."""
    weights, size, offsets = LAYOUT[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, k // weights, size), dtype=np.uint8)
    for offset in offsets:
        scale = 2.0 ** rng.integers(-12, -6, size=blocks.shape[:2]) if exact else rng.uniform(2**-12, 2**-6,
                                                                                               blocks.shape[:2])
        blocks[..., offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def random_q4k(rows: int, k: int, seed: int, exact: bool = False) -> np.ndarray:
    return random_blocks(Q4_K, rows, k, seed, exact)


def gguf_dequantize(blocks: np.ndarray, kind: GGMLQuantizationType = Q4_K) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(blocks, kind))


@pytest.mark.parametrize("kind", [T.Q6_K, T.Q8_0, T.Q5_0, T.Q4_0])
def test_symmetric_blocks_decode_to_exactly_ggufs_values(kind):
    blocks = random_blocks(kind, 24, 512, seed=int(kind))
    weight = decode(kind, torch.from_numpy(blocks))
    assert isinstance(weight, w4a8.SymmetricWeight) and weight.q.shape == (24, 512)
    assert int(weight.q.max()) < 16 << weight.bits and int(weight.q.max()) >= 8 << weight.bits  # every bit used
    expected = gguf_dequantize(blocks, kind).double()
    assert torch.equal(weight.dequantize(), expected)  # gguf-py's float32 values are exact here


@pytest.mark.parametrize("kind", list(DECODERS))
def test_decoders_refuse_rows_of_another_size(kind):
    with pytest.raises(ValueError, match=f"{kind.name} rows"):
        decode(kind, torch.zeros(4, LAYOUT[kind][1] + 1, dtype=torch.uint8))


def test_decode_is_gguf_dequantize_bit_for_bit_where_the_scales_are_exact():
    blocks = random_q4k(24, 512, seed=1, exact=True)
    weight = decode_q4_k(torch.from_numpy(blocks))
    assert weight.q.shape == (24, 512) and weight.d.shape == weight.m.shape == (24, 2)
    assert weight.sc.shape == weight.mn.shape == (24, 16) and weight.sc.dtype == weight.mn.dtype == torch.uint8
    assert int(weight.q.max()) == 15 and weight.d.dtype == weight.m.dtype == torch.float16
    assert int(weight.sc.max()) == int(weight.mn.max()) == 63  # 6-bit multipliers, unpacked
    assert torch.equal(weight.dequantize(), gguf_dequantize(blocks))


def test_decode_is_gguf_dequantize_bit_for_bit_whatever_the_scales():
    """Random float16 d and dmin: their products with the 6-bit multipliers are mostly not float16 values (a
    rounding of them to float16, as the kernel did before, differs from gguf-py here); they are not rounded."""
    blocks = random_q4k(40, 768, seed=2)
    weight = decode_q4_k(torch.from_numpy(blocks))
    assert torch.equal(weight.dequantize(), gguf_dequantize(blocks))
    rounded = w4a8.QuantizedWeight(weight.q, weight.per_block().d.half(), weight.per_block().m.half())
    assert not torch.equal(rounded.dequantize(), gguf_dequantize(blocks))  # the check above is not vacuous


def test_saved_weights_decode_on_demand_with_their_types(tmp_path):
    blocks = {"a.proj": (Q4_K, torch.from_numpy(random_q4k(8, 256, seed=3))),
              "b.proj": (T.Q6_K, torch.from_numpy(random_blocks(T.Q6_K, 8, 256, seed=4)))}
    save_published(blocks, tmp_path / "p.safetensors")
    published = PublishedWeights(tmp_path / "p.safetensors")
    assert list(published) == ["a.proj", "b.proj"] and published.get("c.proj") is None
    assert published.kind("b.proj") == T.Q6_K
    for name, (kind, rows) in blocks.items():
        assert torch.equal(published[name].q, decode(kind, rows).q)
    # a file of the Q4_K-only format (before every block type was kept) is not read as this one
    save_file({"a.proj": blocks["a.proj"][1]}, str(tmp_path / "old.safetensors"), metadata={"format": "gguf-q4_k"})
    with pytest.raises(ValueError, match="not a file of published"):
        PublishedWeights(tmp_path / "old.safetensors")


def same_packed(a, b) -> bool:
    """Whether two packed weights hold the same layout and values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same_packed(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return all(same_packed(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


@pytest.fixture
def q4k_gguf(tmp_path):
    """A tiny Llama GGUF with five Linear weights in GGUF block types (returns its path and their raw blocks)."""
    target, _, tokenizer = make_pair(device="cpu", **SIZE)
    raw = {}
    for i, (name, (module, kind)) in enumerate(REPACKED.items()):
        rows, k = target.get_submodule(module).weight.shape
        raw[name] = (random_blocks(kind, rows, k, seed=i), kind)
    return write_tiny_gguf(tmp_path / "blocks.gguf", target, tokenizer, raw), raw


def test_published_rows_are_in_the_model_order_transformers_loads(q4k_gguf, tmp_path):
    path, raw = q4k_gguf
    built = cached_conversion(tmp_path / "cache", "tiny", lambda _: path, progress=False)
    published = published_weights(built)
    assert {name: published.kind(name) for name in published} == dict(REPACKED.values())
    floats = load_file(built / "model.safetensors")  # transformers' dequantized (and q/k un-permuted) weights
    for module, _ in REPACKED.values():
        mine, theirs = published[module].dequantize().float(), floats[f"{module}.weight"].float()
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
        if isinstance(weight, w4a8.SymmetricWeight):  # every other block type: as published, not rounded to 4 bits
            assert same_packed(module.packed, w4a8.pack_symmetric(weight)), name
            continue
        expected = w4a8.pack(weight)
        assert torch.equal(module.packed.q, expected.q), name
        assert torch.equal(module.packed.one_level().d, expected.one_level().d)
        assert torch.equal(module.packed.one_level().m, expected.one_level().m)
        assert (module.packed.levels is not None) == (name in published)  # published: the two levels kept
        if name in published:
            assert all(torch.equal(getattr(module.packed.levels, f), getattr(expected.levels, f))
                       for f in ("d", "m", "sc", "mn"))
    # layer 0's q (Q4_K), k (Q8_0) and v (Q5_0) run fused: each part in its own layout, side by side
    fused = loaded.target.get_submodule("model.layers.0.self_attn.qkv_proj").packed
    parts = [w4a8.pack(published["model.layers.0.self_attn.q_proj"])] + [
        w4a8.pack_symmetric(published[f"model.layers.0.self_attn.{n}_proj"]) for n in "kv"]
    assert isinstance(fused, w4a8.PackedParts) and same_packed(fused, w4a8.PackedParts(tuple(parts), 512))
    assert len(published) == 5


def test_a_block_type_no_decoder_reads_is_left_to_rounding_and_said_once(tmp_path, caplog):
    """A Linear weight of a type the kernel does not read as published (Q4_1 here; Q5_K in a real file) is not
    among the published ones, and one warning names how many such weights of which types the file has."""
    target, _, tokenizer = make_pair(device="cpu", **SIZE)
    raw = {}
    for i, (name, module, kind) in enumerate([("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj", T.Q4_1),
                                              ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj", T.Q4_1),
                                              ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj", T.Q8_0)]):
        rows, k = target.get_submodule(module).weight.shape
        raw[name] = (random_blocks(kind, rows, k, seed=i), kind)
    path = write_tiny_gguf(tmp_path / "q4_1.gguf", target, tokenizer, raw)
    with torch.device("meta"):
        skeleton = type(target)(target.config)
    with caplog.at_level("WARNING", logger="fly_llm.model.kernels.gguf_blocks"):
        found = published_blocks(path, skeleton)
    assert {name: kind for name, (kind, _) in found.items()} == {"model.layers.0.self_attn.k_proj": T.Q8_0}
    (record,) = caplog.records
    assert "2 Linear weights" in record.getMessage() and "(2 Q4_1)" in record.getMessage()


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
    assert len(published_weights(built)) == 5
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
