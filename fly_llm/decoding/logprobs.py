"""The target's log-probabilities of tokens, for the requests that ask for them (OpenAI's `logprobs`).

The log-softmax of the target's raw logits at a position (temperature 1, before any sampling filter:
no temperature, top-p or grammar mask), read at the token that came next, with the `top` most likely
tokens at that position.
"""

from __future__ import annotations

import torch

Logprob = tuple[float, list[tuple[int, float]]]
"""A token's log-probability, and the `top` most likely tokens at its position with theirs (most likely first)."""

PIECE = 256
"""Positions turned into log-probabilities at once (bounds the float32 copy of the logits)."""


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[Logprob]:
    """The log-probability of `tokens[i]` under `logits[i]` ([n, vocab], n >= len(tokens)) and the `top`
    most likely tokens there, for each i."""
    out: list[Logprob] = []
    for start in range(0, len(tokens), PIECE):
        piece = tokens[start:start + PIECE]
        lp = logits[start:start + len(piece)].float().log_softmax(-1)
        ids = torch.tensor(piece, device=lp.device)
        chosen = lp.gather(-1, ids[:, None])[:, 0].tolist()
        if top:
            values, indices = lp.topk(top, -1)
            tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        else:
            tops = [[] for _ in piece]
        out += zip(chosen, tops)
    return out
