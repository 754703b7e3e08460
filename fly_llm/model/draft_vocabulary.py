"""A draft model's output head over part of the vocabulary, as FR-Spec does (issue 44: a cheaper draft step).

Every draft step streams the draft's whole output head: the embedded 0.5B draft's is 151,936 rows of Q8_0,
145 MB of the 392 MB a step reads. The draft only proposes and the target verifies over the full
vocabulary, so a draft that scores only `size` tokens changes which drafts are offered, never what exact
mode emits; a token outside the kept set is simply never drafted (the n-gram stage may still propose it).

Which tokens: a byte-level BPE vocabulary (Qwen, Llama 3, GPT-2) numbers its tokens in merge order, the
order of their frequency in the tokenizer's training corpus, so the lowest ids are the most frequent ones;
every special and added token (end of turn, fill-in-the-middle markers) is kept too. No data is needed.
Measured on the embedded pair (benchmarks/results/draft-vocabulary).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fly_llm.common.errors import ModelError
from fly_llm.model.kernels.w4a8 import select_rows

HEAD = "lm_head"
"""The output head's name in a transformers causal LM (and in a GGUF's published weights)."""


class SubsetHead(nn.Module):
    """An output head that scores only the tokens `keep` (sorted int64 ids): full-vocabulary logits, -inf
    at every other token, so argmax and softmax over them pick among `keep` alone."""

    def __init__(self, head: nn.Module, keep: torch.Tensor, vocabulary: int) -> None:
        """`head`: a layer scoring exactly the tokens `keep`, in that order; `vocabulary`: the logits' width."""
        super().__init__()
        self.inner = head
        self.register_buffer("keep", keep)
        self.vocabulary = vocabulary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits [..., vocabulary]."""
        scores = self.inner(hidden)
        logits = scores.new_full((*scores.shape[:-1], self.vocabulary), float("-inf"))
        return logits.index_copy_(-1, self.keep, scores)

    def extra_repr(self) -> str:
        return f"keeps {self.keep.numel():,} of {self.vocabulary:,} tokens"


def kept_tokens(tokenizer: PreTrainedTokenizerBase, size: int, vocabulary: int) -> torch.Tensor:
    """The sorted ids a head of `size` tokens keeps out of `vocabulary`: every special and added token, then
    the lowest other ids (for a BPE vocabulary, the most frequent tokens)."""
    special = {i for i in (*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder) if 0 <= i < vocabulary}
    if size < len(special) + 1:
        raise ModelError(f"draft_vocabulary={size} keeps fewer tokens than the tokenizer's {len(special)} special ones")
    plain = [i for i in range(vocabulary) if i not in special][:size - len(special)]
    return torch.tensor(sorted(special.union(plain)), dtype=torch.int64)


def restrict_head(model: PreTrainedModel, keep: torch.Tensor,
                  published: Mapping[str, object] | None) -> Mapping[str, object] | None:
    """Replace `model`'s output head by a SubsetHead over `keep`; returns `published` (a GGUF's published
    weights by Linear name, or None) with the kept rows of the head's published weight under the new
    Linear's name, so a quantizer takes those rows as published."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ModelError(f"the draft's output head is a {type(head).__name__}, not a Linear: draft_vocabulary "
                         "needs a Linear head")
    inner = nn.Linear(head.in_features, keep.numel(), bias=head.bias is not None,
                      device=head.weight.device, dtype=head.weight.dtype)
    index = keep.to(head.weight.device)
    with torch.no_grad():
        inner.weight.copy_(head.weight[index])
        if head.bias is not None:
            inner.bias.copy_(head.bias[index])
    model.set_output_embeddings(SubsetHead(inner, index, head.out_features))
    if published is None or HEAD not in published:
        return published
    return ChainMap({f"{HEAD}.inner": select_rows(published[HEAD], keep)}, published)


def kept_count(model: nn.Module | None) -> int:
    """How many tokens `model`'s output head scores when it is a SubsetHead; 0 for a full head (or no model)."""
    head = model.get_output_embeddings() if model is not None else None
    return head.keep.numel() if isinstance(head, SubsetHead) else 0


def restrict_draft_vocabulary(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, size: int,
                              published: Mapping[str, object] | None) -> Mapping[str, object] | None:
    """`restrict_head` to the `size` tokens `kept_tokens` picks; nothing changes when size is 0 or at least
    the head's width. Returns the published weights to quantize the model with."""
    head = model.get_output_embeddings()
    if size <= 0 or head is None or size >= head.out_features:
        return published
    return restrict_head(model, kept_tokens(tokenizer, size, head.out_features), published)
