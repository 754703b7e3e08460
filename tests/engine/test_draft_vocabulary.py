"""A draft's output head over part of the vocabulary (fly_llm.model.draft_vocabulary, issue 44).

The subset head's logits at the kept tokens are the full head's own (bit for bit under w4a8 over a GGUF's
published rows, whose columns the kernel computes independently), every other token is -inf, and exact mode with such a draft still emits the
target's greedy output token for token.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from fly_llm.common.config import ModelSpec
from fly_llm.common.errors import ModelError
from fly_llm.model.draft_vocabulary import (SubsetHead, kept_count, kept_tokens, restrict_draft_vocabulary,
                                            restrict_head)
from fly_llm.model.kernels import w4a8
from fly_llm.model.pair import load_models
from fly_llm.model.quantization import quantize
from fly_llm.model.w4a8_layers import W4A8Linear
from support.tiny_models import exact_mode_matches_greedy, make_pair, write_tiny_gguf
from test_gguf_blocks import random_blocks

needs_w4a8 = pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")


def test_kept_tokens_are_the_special_ones_then_the_lowest_ids():
    _, _, tokenizer = make_pair(device="cpu", fim=True)
    special = sorted(set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder))
    keep = kept_tokens(tokenizer, 40, len(tokenizer))
    assert keep.tolist() == sorted(keep.tolist()) and keep.numel() == 40 and keep.dtype == torch.int64
    assert set(special) <= set(keep.tolist())
    plain = [i for i in keep.tolist() if i not in special]
    assert plain == [i for i in range(len(tokenizer)) if i not in special][:len(plain)]
    with pytest.raises(ModelError, match="special"):
        kept_tokens(tokenizer, len(special), len(tokenizer))


def test_subset_head_scores_the_kept_tokens_as_the_full_head_and_no_other():
    head = nn.Linear(64, 320, bias=True)
    keep = torch.tensor([0, 3, 17, 100, 319])
    inner = nn.Linear(64, 5, bias=True)
    with torch.no_grad():
        inner.weight.copy_(head.weight[keep])
        inner.bias.copy_(head.bias[keep])
    subset = SubsetHead(inner, keep, 320)
    hidden = torch.randn(2, 3, 64)
    with torch.no_grad():
        full, mine = head(hidden), subset(hidden)
    assert mine.shape == full.shape
    torch.testing.assert_close(mine[..., keep], full[..., keep])  # BLAS may block a narrower matmul otherwise
    others = torch.ones(320, dtype=torch.bool)
    others[keep] = False
    assert torch.isneginf(mine[..., others]).all()
    assert set(mine.argmax(-1).flatten().tolist()) <= set(keep.tolist())


@pytest.mark.parametrize("make_weight", [
    lambda w: w4a8.quantize_weight(w),
    lambda w: w4a8.SymmetricWeight(torch.randint(0, 256, w.shape, dtype=torch.uint8),
                                   torch.rand(w.shape[0], w.shape[1] // 32).half(), None, bits=4, zero=128),
    lambda w: w4a8.SymmetricWeight(torch.randint(0, 64, w.shape, dtype=torch.uint8),
                                   torch.rand(w.shape[0], w.shape[1] // 256).half(),
                                   torch.randint(-128, 128, (w.shape[0], w.shape[1] // 16), dtype=torch.int8),
                                   bits=2, zero=32, span=8),
], ids=["4-bit", "q8_0", "q6_k"])
def test_selected_rows_are_those_rows_of_the_weight(make_weight):
    weight = make_weight(torch.randn(48, 256))
    index = torch.tensor([1, 2, 30, 47])
    assert torch.equal(w4a8.select_rows(weight, index).dequantize(), weight.dequantize()[index])


def tiny_pair_with_q8_head(tmp_path):
    """A tiny Llama target and draft as GGUF files whose output heads are published Q8_0 blocks."""
    target, draft, tokenizer = make_pair(device="cpu", hidden_size=256, intermediate_size=512)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        rows, k = model.lm_head.weight.shape
        raw = {"output.weight": (random_blocks(GGMLQuantizationType.Q8_0, rows, k, seed=len(paths)),
                                 GGMLQuantizationType.Q8_0)}
        paths.append(write_tiny_gguf(tmp_path / f"{name}.gguf", model, tokenizer, raw))
    return paths


@needs_w4a8
def test_a_published_head_keeps_its_kept_rows_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path / "cache"))
    target, draft = tiny_pair_with_q8_head(tmp_path)
    spec = dict(target=str(target), draft=str(draft), dtype="float32", device="cpu", draft_quantization="w4a8",
                draft_weights="published")
    full = load_models(ModelSpec(**spec), progress=False)
    pruned = load_models(ModelSpec(**spec, draft_vocabulary=100), progress=False)
    head = pruned.draft.lm_head
    assert isinstance(head, SubsetHead) and pruned.draft_vocabulary == kept_count(pruned.draft) == 100
    assert full.draft_vocabulary == 0 and isinstance(full.draft.lm_head, W4A8Linear)
    assert isinstance(head.inner.packed, w4a8.PackedSymmetric)  # the published Q8_0 rows, not rounded to 4 bits
    hidden = torch.randn(3, 256)
    with torch.no_grad():
        mine, theirs = head(hidden), full.draft.lm_head(hidden)
    assert torch.equal(mine[:, head.keep], theirs[:, head.keep])  # the kernel's columns: the same bits


def test_a_float_draft_restricted_keeps_its_rows_and_every_input_token():
    _, draft, tokenizer = make_pair(device="cpu")
    before = draft.lm_head.weight.detach().clone()
    published = restrict_draft_vocabulary(draft, tokenizer, 64, None)
    assert published is None and isinstance(draft.lm_head, SubsetHead)
    assert torch.equal(draft.lm_head.inner.weight, before[draft.lm_head.keep])
    assert draft.get_input_embeddings().weight.shape[0] == before.shape[0]  # the input side keeps every token


@needs_w4a8
def test_quantizing_a_restricted_draft_packs_its_subset():
    _, draft, tokenizer = make_pair(device="cpu")
    restrict_draft_vocabulary(draft, tokenizer, 64, None)
    assert quantize(draft, "w4a8", torch.device("cpu"), "draft") == "w4a8"
    assert isinstance(draft.lm_head, SubsetHead) and isinstance(draft.lm_head.inner, W4A8Linear)
    assert draft.lm_head.inner.out_features == 64


def test_no_restriction_at_zero_or_at_the_full_width():
    _, draft, tokenizer = make_pair(device="cpu")
    head = draft.lm_head
    assert restrict_draft_vocabulary(draft, tokenizer, 0, {"x": 1}) == {"x": 1} and draft.lm_head is head
    assert restrict_draft_vocabulary(draft, tokenizer, head.out_features, None) is None and draft.lm_head is head
    assert kept_count(draft) == 0 and kept_count(None) == 0


def test_a_head_that_is_not_a_linear_is_refused():
    _, draft, tokenizer = make_pair(device="cpu")
    draft.set_output_embeddings(nn.Sequential(draft.lm_head))
    with pytest.raises(ModelError, match="not a Linear"):
        restrict_head(draft, torch.tensor([0, 1]), None)


@pytest.mark.parametrize("quantization", ["none", "w4a8"])
def test_exact_mode_with_a_subset_draft_is_the_targets_greedy_output(tiny_pair_dirs, quantization):
    if quantization == "w4a8" and not w4a8.available():
        pytest.skip("the w4a8 kernel cannot be built or run here")
    target, draft = tiny_pair_dirs
    loaded = load_models(ModelSpec(target=str(target), draft=str(draft), dtype="float32", device="cpu",
                                   target_quantization=quantization, draft_quantization=quantization,
                                   draft_vocabulary=48), progress=False)
    assert isinstance(loaded.draft.lm_head, SubsetHead) and loaded.draft_vocabulary == 48
    exact_mode_matches_greedy(loaded, ["hello world", "the cat sat on", "a"], max_tokens=24)


def test_the_setting_refuses_a_negative_size():
    with pytest.raises(ValueError):
        ModelSpec(draft_vocabulary=-1)
