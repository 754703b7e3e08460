"""The real embedded pair (Qwen2.5-Coder 1.5B target / 0.5B draft): lossless exact mode, working FLy.

The tests share one loaded pair and run in file order: exactness in float32 first, then FLy in
bfloat16 (the second test casts the pair).

Slow (minutes on a CPU) and needs `fly-llm[models]`; builds the safetensors cache on first use.
Run with `python -m pytest tests/engine/test_default_models_slow.py -m slow -s`.
"""

from __future__ import annotations

import pytest
import torch

from support.device import TEST_DEVICE
from fly_llm.common.config import FLyConfig, ModelSpec, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.model.pair import load_models

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

TOKENS = 48
QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash table is.",
    "Write a Python function is_prime(n) with a docstring.",
]
FLY_QUESTIONS = [
    "Explain in two sentences what a hash table is.",
    "Write a short paragraph about why unit tests matter.",
    "Write a Python function that merges two sorted lists, with comments.",
]


@pytest.fixture(scope="module")
def pair():
    """The default pair, loaded in float32 (exactness is asserted in float32, docs/design.md §1.2)."""
    return load_models(ModelSpec(dtype="float32", device=TEST_DEVICE), progress=False)


def _prompts(tokenizer, questions: list[str]) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in questions]


def _target_greedy(pair, prompt: str) -> list[int]:
    """The target's own greedy continuation (Hugging Face generate), stopped at EOS."""
    ids = torch.tensor([pair.tokenizer.encode(prompt)], device=pair.target.device)
    with torch.inference_mode():
        out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS,
                                   do_sample=False, pad_token_id=pair.tokenizer.pad_token_id)
    return _until_eos(out[0, ids.shape[1]:].tolist(), pair)


def _until_eos(tokens: list[int], pair) -> list[int]:
    eos = pair.target.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    eos.add(pair.tokenizer.eos_token_id)
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


def test_default_pair_shares_vocabulary(pair):
    assert pair.draft is not None and pair.draft_name and pair.target_name
    assert pair.context_window == 32_768
    assert pair.tokenizer.chat_template and "<|im_start|>" in _prompts(pair.tokenizer, QUESTIONS)[0]


def test_exact_mode_equals_target_greedy(pair):
    """float32: FLy off is token-for-token the target's own greedy output (3 prompts x 48 tokens)."""
    prompts = _prompts(pair.tokenizer, QUESTIONS)
    engine = FLyEngine(pair.target, pair.tokenizer, pair.draft, FLyConfig(loose=False),
                       context_window=pair.context_window)
    exact = engine.generate(prompts, SamplingParams(max_tokens=TOKENS))
    for prompt, result in zip(prompts, exact):
        assert _until_eos(result.token_ids, pair) == _target_greedy(pair, prompt)
        assert result.stats.accepted_loose == 0


def test_fly_is_coherent_and_accepts_loosely(pair):
    """bfloat16 (the CPU default here), K=15 n-gram -> draft cascade as in the paper: loose accepts happen.

    The adaptive policy is off: it often shortens K below the window W + 1, where no mismatch
    can be loosely accepted, which is a speed choice, not what this test is about.
    """
    for model in (pair.target, pair.draft):
        model.to(torch.bfloat16)
    prompts = _prompts(pair.tokenizer, FLY_QUESTIONS)
    engine = FLyEngine(pair.target, pair.tokenizer, pair.draft, FLyConfig(adaptive=False),
                       context_window=pair.context_window)
    fly = engine.generate(prompts, SamplingParams(max_tokens=64))
    for question, result in zip(FLY_QUESTIONS, fly):
        print(f"\n{question!r}: MAT {result.stats.mat:.2f}, loose {result.stats.accepted_loose}, "
              f"native {result.stats.accepted_native}\n{result.text}")
        assert result.completion_tokens >= 24 and "\ufffd" not in result.text
    assert "hash" in fly[0].text.lower() and "test" in fly[1].text.lower()
    assert "def merge" in fly[2].text
    assert sum(r.stats.accepted_loose for r in fly) > 0
