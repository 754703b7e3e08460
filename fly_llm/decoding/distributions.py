"""The distribution a sampling row draws from: the target's logits through temperature, top-k, top-p and min-p.

The order is Hugging Face's and vLLM's (llama.cpp's default chain keeps the same filters in the same order):
softmax(z / T), then the k most likely tokens, then the top-p nucleus of what is left (renormalised), then the
tokens at least min_p times as likely as the most likely one. Ties at a cut all stay. Each filter keeps the
most likely token, so every row keeps a distribution, and greedy decoding (its argmax) is unchanged by them.
The penalties (`fly_llm.decoding.penalties`) act before, on the logits. Rows of one batch may differ in every
setting; a filter at its off value (top_k 0, top_p 1, min_p 0) leaves its row as it is.
"""

from __future__ import annotations

import torch


def distributions(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
                  top_ks: list[int] | None = None, min_ps: list[float] | None = None) -> torch.Tensor:
    """softmax(logits / T) per row, then cut by the row's top_k, top_p and min_p and renormalised.

    `logits` [S, K+1, V] must be a copy owned by the caller: it is scaled in place. Safe for any T > 0:
    the row's maximum is subtracted first (so nothing overflows: a T near 0 leaves the maximum at 0
    and the rest at -inf, the greedy limit) and T is at least the dtype's smallest normal number.
    """
    scale = torch.tensor(temperatures, device=logits.device, dtype=logits.dtype)
    scale.clamp_(min=torch.finfo(logits.dtype).tiny)
    logits.sub_(logits.amax(-1, keepdim=True)).div_(scale[:, None, None])
    probs = torch.softmax(logits, -1)
    if top_ks is not None and any(0 < k < probs.shape[-1] for k in top_ks):
        _keep_top_k_(probs, top_ks)
    if min(top_ps) < 1.0:
        _keep_nucleus_(probs, torch.tensor(top_ps, device=logits.device, dtype=probs.dtype)[:, None, None])
    if min_ps is not None and max(min_ps) > 0.0:
        _keep_min_p_(probs, torch.tensor(min_ps, device=logits.device, dtype=probs.dtype)[:, None, None])
    return probs


def _keep_top_k_(probs: torch.Tensor, top_ks: list[int]) -> None:
    """In place: keep each row's top_k most likely tokens (and those tied with the k-th), renormalised;
    rows with top_k 0 or at least the vocabulary keep everything. One topk, as wide as the widest row's k."""
    vocab = probs.shape[-1]
    kept = [k if 0 < k < vocab else vocab for k in top_ks]
    top = probs.topk(max(k for k in kept if k < vocab), -1).values
    last = torch.tensor([min(k, top.shape[-1]) - 1 for k in kept], device=probs.device)
    edge = top.gather(-1, last[:, None, None].expand(*top.shape[:-1], 1))
    off = torch.tensor([k == vocab for k in kept], device=probs.device)[:, None, None]
    probs.masked_fill_(probs < torch.where(off, 0.0, edge), 0.0)
    probs.div_(probs.sum(-1, keepdim=True))


def _keep_min_p_(probs: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: keep the tokens at least min_p times as likely as the row's most likely one, renormalised."""
    probs.masked_fill_(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    probs.div_(probs.sum(-1, keepdim=True))


def _keep_nucleus_(probs: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place: keep the smallest set of most likely tokens whose mass reaches top_p, renormalised.

    Tokens tied with the least likely kept one all stay. The nucleus is found with topk over
    a prefix of the sorted vocabulary that grows until it covers top_p, not a full sort
    (one small host read per growth step).
    """
    vocab = probs.shape[-1]
    width = min(vocab, 64)
    while True:
        top = probs.topk(width, -1).values
        if width == vocab or bool(((top.sum(-1, keepdim=True) >= top_p) | (top_p >= 1.0)).all()):
            break
        width = min(vocab, width * 8)
    kept = ((top.cumsum(-1) - top) < top_p).sum(-1, keepdim=True).clamp(min=1)  # a top_p that underflowed to 0: 1
    edge = torch.where(top_p >= 1.0, 0.0, top.gather(-1, kept - 1))
    probs.masked_fill_(probs < edge, 0.0)
    probs.div_(probs.sum(-1, keepdim=True))
