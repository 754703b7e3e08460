"""Quantized Linear layers and quantized models (fly_llm.model.quantization): accuracy, row independence,
the choice of scheme, and exact mode on a quantized target (the target as it runs)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from support.tiny_models import exact_mode_matches_greedy

from fly_llm.common.config import ModelSpec
from fly_llm.common.errors import ModelError
from fly_llm.model import quantization
from fly_llm.model.kernels import w4a8
from fly_llm.model.pair import load_models
from fly_llm.model.quantization import (Int4Linear, Int8Linear, int4_available, int8_available, quantization_of, quantize,
                                  resolve_quantization)

CPU = torch.device("cpu")
needs_int8 = pytest.mark.skipif(not int8_available(), reason="torch has no fbgemm int8 kernels here")
needs_int4 = pytest.mark.skipif(not int4_available(), reason="torch has no CPU int4 kernel here")
needs_w4a8 = pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")
LAYERS = [pytest.param(Int8Linear, 0.05, marks=needs_int8), pytest.param(Int4Linear, 0.15, marks=needs_int4)]


def _linear(inputs: int, outputs: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(inputs, outputs, bias=bias)


@pytest.mark.parametrize(("layer", "tolerance"), LAYERS)
def test_quantized_linear_is_close_to_float(layer, tolerance):
    linear = _linear(128, 96)
    x = torch.randn(3, 5, 128)
    reference, out = linear(x), layer(linear)(x)
    assert out.shape == reference.shape and out.dtype == x.dtype
    assert ((out - reference).norm() / reference.norm()).item() < tolerance


@pytest.mark.parametrize(("layer", "tolerance"), LAYERS)
def test_a_rows_result_does_not_depend_on_the_batch(layer, tolerance):
    """Exact mode verifies K+1 tokens of B rows at once, the reference decodes one token alone."""
    quantized = layer(_linear(128, 64))
    x = torch.randn(16, 128)
    batched = quantized(x)
    alone = torch.cat([quantized(x[i:i + 1]) for i in range(16)])
    louder = x.clone()
    louder[7] *= 1000  # one loud neighbour: a per-tensor activation scale would change every row
    torch.testing.assert_close(alone, batched, rtol=0, atol=0 if layer is Int8Linear else 1e-5)
    torch.testing.assert_close(quantized(louder)[:7], batched[:7], rtol=0, atol=0 if layer is Int8Linear else 1e-5)


@needs_int8
def test_int8_without_bias_and_in_bfloat16():
    linear = _linear(64, 32, bias=False)
    out = Int8Linear(linear)(torch.randn(4, 64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (4, 32)


def _auto_on_cpu() -> str:
    """What 'auto' should give here: w4a8 where its kernel runs (AVX2 or AVX-512 VNNI), else int8 (docs/models.md)."""
    if w4a8.available():
        return "w4a8"
    return "int8" if int8_available() else "none"


def test_auto_is_w4a8_or_int8_on_cpu_and_float_on_gpu():
    assert resolve_quantization("auto", CPU) == _auto_on_cpu()
    assert resolve_quantization("auto", torch.device("cuda")) == "none"
    assert resolve_quantization("none", torch.device("cuda")) == "none"
    with pytest.raises(ModelError, match="runs on CPU only"):
        resolve_quantization("int8", torch.device("cuda"))


def test_auto_takes_w4a8_wherever_its_kernel_runs_and_int8_elsewhere(monkeypatch):
    monkeypatch.setitem(quantization._AVAILABLE, "w4a8", lambda: True)  # an AVX2-only CPU counts too
    assert resolve_quantization("auto", CPU) == "w4a8"
    monkeypatch.setitem(quantization._AVAILABLE, "w4a8", lambda: False)
    monkeypatch.setitem(quantization._AVAILABLE, "int8", lambda: True)
    assert resolve_quantization("auto", CPU) == "int8"
    monkeypatch.setitem(quantization._AVAILABLE, "int8", lambda: False)
    assert resolve_quantization("auto", CPU) == "none"


def test_a_missing_kernel_falls_back_or_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(quantization, "int8_available", lambda: False)
    monkeypatch.setitem(quantization._AVAILABLE, "int8", lambda: False)
    monkeypatch.setitem(quantization._AVAILABLE, "int4", lambda: False)
    monkeypatch.setitem(quantization._AVAILABLE, "w4a8", lambda: False)
    assert resolve_quantization("auto", CPU) == "none"
    with pytest.raises(ModelError, match="fbgemm"):
        resolve_quantization("int8", CPU, "target")
    with pytest.raises(ModelError, match="_weight_int4pack_mm_for_cpu"):
        resolve_quantization("int4", CPU, "draft")
    with pytest.raises(ModelError, match="unknown target_quantization"):
        resolve_quantization("int3", CPU)


@needs_int4
def test_int4_keeps_layers_its_kernel_cannot_pack():
    model = torch.nn.Sequential(_linear(64, 32), _linear(32, 8), _linear(8, 48))
    assert quantize(model, "int4", CPU) == "int4"
    assert isinstance(model[0], Int4Linear) and type(model[1]) is type(model[2]) is torch.nn.Linear
    assert quantization_of(model) == "int4" and quantization_of(torch.nn.Linear(2, 2)) == "none"


@pytest.mark.parametrize("scheme", [pytest.param("int8", marks=needs_int8), pytest.param("int4", marks=needs_int4),
                                    pytest.param("w4a8", marks=needs_w4a8), "none"])
def test_exact_mode_reproduces_the_quantized_target(tiny_pair_dirs, scheme):
    """FLy off → the greedy output of the target as it runs (here: quantized), token for token."""
    target_dir, draft_dir = tiny_pair_dirs
    loaded = load_models(ModelSpec(target=str(target_dir), draft=str(draft_dir), dtype="float32", device="cpu",
                                   target_quantization=scheme, draft_quantization=scheme), progress=False)
    assert loaded.target_quantization == quantization_of(loaded.target) == scheme
    assert loaded.draft_quantization == quantization_of(loaded.draft) == scheme
    exact_mode_matches_greedy(loaded, ["def add(a, b):", "x", "the quick brown fox " * 6], 24)


def test_auto_quantizes_both_models_on_cpu(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    loaded = load_models(ModelSpec(target=str(target_dir), draft=str(draft_dir), device="cpu"), progress=False)
    expected = _auto_on_cpu()
    assert (loaded.target_quantization, loaded.draft_quantization) == (expected, expected)


@needs_int8
def test_a_quantized_target_scores_a_token_the_same_however_it_is_scheduled(tiny_pair_dirs):
    """Bit for bit: a full forward, prefill + a 3-token verify, 1-token decode steps, and a left-padded
    batch beside a longer row. With int8 activations, attention's last-bit differences between these
    would be amplified into different greedy tokens on a real model (docs/models.md)."""
    loaded = load_models(ModelSpec(target=str(tiny_pair_dirs[0]), draft="none", dtype="float32", device="cpu",
                                   target_quantization="int8"), progress=False)
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
        other = loaded.tokenizer.encode("def add(a, b): return a + b  # " * 6)[:len(ids) + 5]
        padded = torch.tensor([[0] * (len(other) - len(ids)) + ids, other])
        mask = (torch.arange(len(other)) >= len(other) - len(ids)).long()
        mask = torch.stack([mask, torch.ones_like(mask)])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        batched = target(padded, attention_mask=mask, position_ids=positions).logits[0, -3:]
    assert torch.equal(verify, full) and torch.equal(steps, full) and torch.equal(batched, full)
