"""A GGUF's published Linear weights taken as they are by the w4a8 kernel (fly_llm.model.kernels.gguf_blocks).

Each decoder is checked against gguf-py's own `dequantize`: every block type (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0,
Q4_0, Q4_1 and Q5_1) decodes to exactly gguf-py's values, bit for bit (the K types' sub-block scales d*sc and
dmin*mn are float32 products, as gguf-py and llama.cpp compute them).
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
from fly_llm.model.kernels.gguf_blocks import (DECODERS, FORMAT, PublishedWeights, decode, is_current, published_blocks,
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
            "blk.1.ffn_down.weight": ("model.layers.1.mlp.down_proj", T.Q6_K),
            "blk.0.ffn_gate.weight": ("model.layers.0.mlp.gate_proj", T.Q5_K),
            "blk.0.ffn_up.weight": ("model.layers.0.mlp.up_proj", T.Q4_1),
            "blk.1.attn_q.weight": ("model.layers.1.self_attn.q_proj", T.Q5_1)}
# Per block type: (weights, bytes) of a block and the byte offsets of its float16 scales.
LAYOUT = {T.Q4_K: (256, 144, (0, 2)), T.Q5_K: (256, 176, (0, 2)), T.Q6_K: (256, 210, (208,)),
          T.Q8_0: (32, 34, (0,)), T.Q5_0: (32, 22, (0,)), T.Q4_0: (32, 18, (0,)), T.Q4_1: (32, 20, (0, 2)),
          T.Q5_1: (32, 24, (0, 2)), T.Q2_K: (256, 84, (80, 82))}


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


@pytest.mark.parametrize("kind", [T.Q4_1, T.Q5_1])
def test_blocks_with_a_minimum_decode_to_exactly_ggufs_values(kind):
    blocks = random_blocks(kind, 24, 512, seed=int(kind))
    weight = decode(kind, torch.from_numpy(blocks))
    assert isinstance(weight, w4a8.QuantizedWeight) and weight.q.shape == (24, 512) and weight.d.shape == (24, 16)
    assert int(weight.q.max()) == (16 << weight.bits) - 1 and weight.bits == (kind == T.Q5_1)  # every bit used
    assert torch.equal(weight.dequantize(), gguf_dequantize(blocks, kind))


@pytest.mark.parametrize("kind", list(DECODERS))
def test_decoders_refuse_rows_of_another_size(kind):
    with pytest.raises(ValueError, match=f"{kind.name} rows"):
        decode(kind, torch.zeros(4, LAYOUT[kind][1] + 1, dtype=torch.uint8))


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q5_K])
def test_decode_is_gguf_dequantize_bit_for_bit_where_the_scales_are_exact(kind):
    blocks = random_blocks(kind, 24, 512, seed=1, exact=True)
    weight = decode(kind, torch.from_numpy(blocks))
    assert weight.q.shape == (24, 512) and weight.d.shape == weight.m.shape == (24, 2)
    assert weight.sc.shape == weight.mn.shape == (24, 16) and weight.sc.dtype == weight.mn.dtype == torch.uint8
    assert int(weight.q.max()) == (16 << weight.bits) - 1 and weight.bits == (kind == T.Q5_K)  # every bit used
    assert weight.d.dtype == weight.m.dtype == torch.float16
    assert int(weight.sc.max()) == int(weight.mn.max()) == 63  # 6-bit multipliers, unpacked
    assert torch.equal(weight.dequantize(), gguf_dequantize(blocks, kind))


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q5_K])
def test_decode_is_gguf_dequantize_bit_for_bit_whatever_the_scales(kind):
    """Random float16 d and dmin: their products with the 6-bit multipliers are mostly not float16 values (a
    rounding of them to float16, as the kernel did before, differs from gguf-py here); they are not rounded."""
    blocks = random_blocks(kind, 40, 768, seed=2)
    weight = decode(kind, torch.from_numpy(blocks))
    assert torch.equal(weight.dequantize(), gguf_dequantize(blocks, kind))
    rounded = w4a8.QuantizedWeight(weight.q, weight.per_block().d.half(), weight.per_block().m.half())
    assert not torch.equal(rounded.dequantize(), gguf_dequantize(blocks, kind))  # the check above is not vacuous


def test_saved_weights_decode_on_demand_with_their_types(tmp_path):
    blocks = {"a.proj": (Q4_K, torch.from_numpy(random_blocks(Q4_K, 8, 256, seed=3))),
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
    # a file written when fewer block types were read lacks the others' tensors: not current, so written anew
    assert is_current(tmp_path / "p.safetensors") and not is_current(tmp_path / "old.safetensors")
    metadata = {"format": FORMAT, "types": json.dumps({"a.proj": "Q4_K"}), "decoded": "Q4_0,Q4_K,Q5_0,Q6_K,Q8_0"}
    save_file({"a.proj": blocks["a.proj"][1]}, str(tmp_path / "fewer.safetensors"), metadata=metadata)
    assert not is_current(tmp_path / "fewer.safetensors")


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
    """A tiny Llama GGUF with Linear weights in each GGUF block type (returns its path and their raw blocks)."""
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

    def packed(name: str) -> w4a8.PackedWeight | w4a8.PackedSymmetric:
        """The layer `name` as it should be packed: published as it is, the others rounded to 4 bits."""
        weight = published[name] if name in published else w4a8.quantize_weight(floats.get_submodule(name).weight)
        return w4a8.pack_symmetric(weight) if isinstance(weight, w4a8.SymmetricWeight) else w4a8.pack(weight)

    for name, module in loaded.target.named_modules():
        if isinstance(module, W4A8Linear):
            assert same_packed(module.packed, packed(name)), name
    layer = "model.layers.{}.{}_proj".format
    # fused layers: each run of one layout joined, the others side by side
    for fused, parts in [(layer(0, "self_attn.qkv"), [layer(0, "self_attn.q"), layer(0, "self_attn.k"),
                                                      layer(0, "self_attn.v")]),  # Q4_K, Q8_0, Q5_0
                         (layer(0, "mlp.gate_up"), [layer(0, "mlp.gate"), layer(0, "mlp.up")]),  # Q5_K, Q4_1
                         (layer(1, "self_attn.qkv"), [layer(1, "self_attn.q"), layer(1, "self_attn.k"),
                                                      layer(1, "self_attn.v")])]:  # Q5_1, then k and v rounded
        assert same_packed(loaded.target.get_submodule(fused).packed, w4a8.concat([packed(p) for p in parts])), fused
    assert isinstance(loaded.target.get_submodule(layer(1, "self_attn.qkv")).packed, w4a8.PackedParts)
    assert len(published) == len(REPACKED)
    x = torch.randn(3, SIZE["hidden_size"])
    for fused, parts in [(layer(0, "mlp.gate_up"), [layer(0, "mlp.gate"), layer(0, "mlp.up")]),
                         (layer(1, "self_attn.qkv"), [layer(1, "self_attn.q")])]:  # the published parts compute
        out = loaded.target.get_submodule(fused)(x)[:, :sum(published[p].q.shape[0] for p in parts)]
        reference = torch.cat([w4a8.reference_linear(x, published[p]) for p in parts], dim=1)
        assert (out.double() - reference).abs().max() <= 1e-5 * reference.abs().max(), fused


def test_a_block_type_no_decoder_reads_is_left_to_rounding_and_said_once(tmp_path, caplog):
    """A Linear weight of a type the kernel does not read as published (Q2_K here) is not among the published
    ones, and one warning names how many such weights of which types the file has."""
    target, _, tokenizer = make_pair(device="cpu", **SIZE)
    raw = {}
    for i, (name, module, kind) in enumerate([("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj", T.Q2_K),
                                              ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj", T.Q2_K),
                                              ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj", T.Q8_0)]):
        rows, k = target.get_submodule(module).weight.shape
        raw[name] = (random_blocks(kind, rows, k, seed=i), kind)
    path = write_tiny_gguf(tmp_path / "q2_k.gguf", target, tokenizer, raw)
    with torch.device("meta"):
        skeleton = type(target)(target.config)
    with caplog.at_level("WARNING", logger="fly_llm.model.kernels.gguf_blocks"):
        found = published_blocks(path, skeleton)
    assert {name: kind for name, (kind, _) in found.items()} == {"model.layers.0.self_attn.k_proj": T.Q8_0}
    (record,) = caplog.records
    assert "2 Linear weights" in record.getMessage() and "(2 Q2_K)" in record.getMessage()


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
    assert len(published_weights(built)) == len(REPACKED)
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
