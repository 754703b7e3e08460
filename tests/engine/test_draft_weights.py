"""The draft's weights stored for speed (ModelSpec.draft_weights, issue 62): 'rounded' packs every Linear of the
draft in the W4A8 kernel's 4-bit layout, a GGUF draft's published 8-bit head included; 'published' keeps the
file's blocks. The draft only proposes: its storage is checked against the published draft by agreement
within a bound, not bit for bit, and exact mode still emits the target's greedy output."""

from __future__ import annotations

import pytest
import torch

from fly_llm.common.config import ModelSpec
from fly_llm.model.kernels import w4a8
from fly_llm.model.pair import load_models
from support.tiny_models import exact_mode_matches_greedy
from test_draft_vocabulary import tiny_pair_with_q8_head

pytestmark = pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")


def _load(paths, storage: str):
    target, draft = paths
    return load_models(ModelSpec(target=str(target), draft=str(draft), dtype="float32", device="cpu",
                                 target_quantization="w4a8", draft_quantization="w4a8", draft_weights=storage),
                       progress=False)


def test_a_rounded_draft_packs_its_published_head_in_four_bits_and_the_target_keeps_its_blocks(tmp_path, monkeypatch):
    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path / "cache"))
    paths = tiny_pair_with_q8_head(tmp_path)
    published, rounded = _load(paths, "published"), _load(paths, "rounded")
    assert isinstance(published.draft.lm_head.packed, w4a8.PackedSymmetric)  # Q8_0 as the file has it
    assert isinstance(rounded.draft.lm_head.packed, w4a8.PackedWeight)  # rounded to 4 bits
    assert rounded.draft_weights == "rounded" and published.draft_weights == "published"
    for loaded in (published, rounded):
        assert isinstance(loaded.target.lm_head.packed, w4a8.PackedSymmetric)  # the target: always as published
    streamed = {m.draft_weights: m.draft.lm_head.packed.streamed_bytes() for m in (published, rounded)}
    assert streamed["rounded"] < 0.7 * streamed["published"]  # 4-bit levels and two float16 scales a block


def test_the_rounded_drafts_greedy_token_mostly_agrees_with_the_published_drafts(tmp_path, monkeypatch):
    """Over random contexts, the next token the rounded draft picks is the published draft's at most
    positions (rounding 8-bit levels to 4 bits moves the logits a little, not the argmax of most rows)."""
    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path / "cache"))
    paths = tiny_pair_with_q8_head(tmp_path)
    published, rounded = _load(paths, "published").draft, _load(paths, "rounded").draft
    ids = torch.randint(0, published.config.vocab_size, (8, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        agree = (published(ids).logits.argmax(-1) == rounded(ids).logits.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree


def test_exact_mode_with_a_rounded_draft_is_the_targets_greedy_output(tmp_path, monkeypatch):
    monkeypatch.setenv("FLY_CACHE_DIR", str(tmp_path / "cache"))
    loaded = _load(tiny_pair_with_q8_head(tmp_path), "rounded")
    exact_mode_matches_greedy(loaded, ["hello world", "the cat sat on", "a"], max_tokens=24)


def test_the_setting_refuses_an_unknown_storage():
    with pytest.raises(ValueError):
        ModelSpec(draft_weights="fast")
