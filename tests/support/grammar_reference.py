"""Reference constrained decoding: HF `generate` with a few-line logits processor over an llguidance matcher.

The engine's exact mode under a grammar must equal this, token for token (float32).
"""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from support.tiny_models import greedy_tokens

_TOKENIZERS: dict[int, llguidance.LLTokenizer] = {}


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (cached per tokenizer object)."""
    key = id(tokenizer)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids)
    return _TOKENIZERS[key]


class GrammarProcessor(LogitsProcessor):
    """Masks each step's scores to the tokens the grammar allows after what was generated so far."""

    def __init__(self, matcher: llguidance.LLMatcher, prompt_length: int, vocab_size: int) -> None:
        self.matcher = matcher
        self.prompt_length = prompt_length
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_length:
            assert self.matcher.consume_token(int(input_ids[0, -1])), self.matcher.get_error()
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask)
        allowed = ((self.bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
        allowed = allowed.to(scores.device)
        scores = scores.clone()
        scores[0, :allowed.numel()][~allowed[:scores.shape[1]]] = float("-inf")
        return scores


def constrained_greedy(target, tokenizer, prompt: list[int], grammar: str, max_new: int, eos_ids: list[int]) -> list[int]:
    """The target's greedy output for `prompt` under `grammar`, through EOS or max_new tokens."""
    vocab = target.get_output_embeddings().weight.shape[0]
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab, eos_ids), grammar)
    assert not matcher.is_error(), matcher.get_error()
    return greedy_tokens(target, prompt, max_new, eos_ids, eos_token_id=eos_ids,
                         logits_processor=LogitsProcessorList([GrammarProcessor(matcher, len(prompt), vocab)]))


def grammar_valid_prefix(tokenizer, vocab_size: int, eos_ids: list[int], grammar: str, tokens: list[int]) -> int:
    """How many leading `tokens` a fresh matcher of `grammar` accepts."""
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size, eos_ids), grammar)
    return matcher.validate_tokens(tokens)
