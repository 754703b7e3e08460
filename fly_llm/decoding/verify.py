"""FLy's acceptance rule (docs/design.md §1, §1.3) as a pure function over batched tensors.

No model calls and no scheduling: `verify` takes each row's draft tokens and the target's
logits for the K+1 positions of one round, and says how many draft tokens each row keeps
and which tokens it emits. The greedy rule is vectorised over the whole batch. A sampling
row (temperature > 0) draws the target's token at each position by inversion, with a uniform that
depends only on its seed and the position's index in its context, and keeps a draft token where that
draw equals it: the rejection test of a point-mass draft (kept with probability p_i(d_i)), and on a
mismatch the draw is a sample of p_i without d_i. So in exact mode a seeded request's text depends on
its seed and its tokens alone: not on what it is batched with, nor on how many tokens a round drafts
(FLy's loose rule keeps some draft tokens that differ from the draw, so its text depends on the drafts).

Per row b with draft length K_b (positions >= K_b are never accepted):

- native[i]: the target agrees with d[i] (greedy: argmax z[i] == d[i]; sampling: the draw of p_i at i equals
  d[i], p_i the row's distribution after temperature, top-k, top-p and min-p:
  fly_llm.decoding.distributions). The logits
  come in with the request's penalties already applied per position (fly_llm.decoding.penalties).
- window W: a mismatch at i is eligible when native[i+1..i+W-1] are all True and
  i < K_b - W (the last W positions are strict). W=1 needs no following matches, so
  every mismatch but the last position's is eligible; W=0 makes every mismatch eligible.
- entropy gate θ: an eligible mismatch is still rejected when the target's entropy there
  is below θ (θ <= 0.01 turns the gate off). The entropy is that of the logits verify
  gets (before temperature and the filters, as in the authors' code; after penalties and grammar masks).
- accept = native | (loose & eligible & not low-entropy); the row keeps d[0..r-1] with r
  the first position not accepted, then emits the target's token at r (greedy: argmax z[r];
  sampling: the draw at r, a sample of p_r with d_r removed, or of p_{K_b} when r == K_b).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from fly_llm.common.config import FLyConfig
from fly_llm.decoding.distributions import distributions

PAD_TOKEN = -1
"""Fills `Verdict.tokens` past each row's emitted tokens."""

_INVERSION_BLOCK = 1024
"""Tokens per block of a sampled draw's first step (`_inverse_cdf`)."""

GATE_OFF_AT = 0.01
"""Entropy thresholds at or below this disable the gate."""


@dataclass(frozen=True)
class RowRules:
    """Per-row FLy settings for one batch (each request may override the daemon's)."""

    loose: torch.Tensor  # [B] bool: FLy's loose acceptance on (off = exact prefix rule)
    window: torch.Tensor  # [B] long: deferred window W
    entropy_threshold: torch.Tensor  # [B] float: gate θ in the measure's unit
    entropy_measure: str = "topk"  # daemon-wide: "topk" (nats) | "full" (normalised by log V)
    entropy_top_k: int = 3

    @classmethod
    def from_configs(cls, configs: Sequence[FLyConfig], device: torch.device | str) -> RowRules:
        """Stack one FLyConfig per row; the entropy measure must be the same for all rows."""
        measures = {(c.entropy_measure, c.entropy_top_k) for c in configs}
        if len(measures) > 1:
            raise ValueError(f"rows disagree on the entropy measure: {sorted(measures)}")
        measure, top_k = measures.pop() if measures else ("topk", 3)
        return cls(
            loose=torch.tensor([c.loose for c in configs], dtype=torch.bool, device=device),
            window=torch.tensor([c.window for c in configs], dtype=torch.long, device=device),
            entropy_threshold=torch.tensor(
                [c.entropy_threshold for c in configs], dtype=torch.float32, device=device
            ),
            entropy_measure=measure,
            entropy_top_k=top_k,
        )

    def rows(self, rows: slice) -> RowRules:
        """These rows' rules."""
        return replace(self, loose=self.loose[rows], window=self.window[rows],
                       entropy_threshold=self.entropy_threshold[rows])


@dataclass
class RowSampling:
    """How each row samples (`fly_llm.decoding.distributions`). Rows with temperature 0 are verified greedily."""

    temperature: torch.Tensor  # [B] float (any device; read on the host once)
    top_p: torch.Tensor  # [B] float in (0, 1]
    seeds: list[int | None]  # per row: its draws come from this seed alone; None: torch's default generator
    top_k: list[int] | None = None  # per row, 0 = off; None: off in every row
    min_p: list[float] | None = None  # per row in [0, 1], 0 = off; None: off in every row
    positions: list[int] | None = None  # per row: the context index of the round's first position (None: 0)

    def rows(self, rows: slice) -> RowSampling:
        """These rows' sampling."""
        return RowSampling(self.temperature[rows], self.top_p[rows], self.seeds[rows],
                           None if self.top_k is None else self.top_k[rows],
                           None if self.min_p is None else self.min_p[rows],
                           None if self.positions is None else self.positions[rows])

    def at(self, positions: list[int]) -> RowSampling:
        """This sampling for a round whose first position is `positions[b]` of row b's context."""
        return replace(self, positions=positions)


@dataclass
class Verdict:
    """What one round keeps and emits, per row."""

    accepted: torch.Tensor  # [B] long: draft tokens kept (r_b, 0..draft_lengths[b])
    tokens: torch.Tensor  # [B, K+1] long: the first accepted[b]+1 are emitted, the rest PAD_TOKEN
    native: torch.Tensor  # [B, K] bool: accepted by the target's own choice / the rejection test
    loose: torch.Tensor  # [B, K] bool: kept only thanks to the FLy rule (inside the kept prefix)


@torch.no_grad()
def verify(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_lengths: torch.Tensor,
    rules: RowRules,
    sampling: RowSampling | None = None,
) -> Verdict:
    """Apply the FLy rule to one round: drafts [B, K], logits [B, K+1, V], lengths [B] (0..K).

    Draft tokens past a row's length are ignored (any value). Returns a Verdict on the
    logits' device; nothing is copied to the host except the sampling rows' settings.
    """
    batch, k = draft_tokens.shape
    device = target_logits.device
    logits = target_logits  # argmax is exact in any dtype; only the few rows that need more are upcast
    lengths = draft_lengths.to(device=device, dtype=torch.long)
    positions = torch.arange(k, device=device)
    valid = positions < lengths[:, None]
    drafts = torch.where(valid, draft_tokens.to(device=device, dtype=torch.long), 0)

    target_choice = logits.max(-1).indices  # [B, K+1]; first maximum, like argmax, but faster on CPU
    native = valid & (target_choice[:, :k] == drafts)
    sampled = _SampledRows.draw(logits, drafts, valid, sampling)
    if sampled is not None:
        native[sampled.rows] = sampled.native

    candidates = valid & ~native & rules.loose[:, None] & _window_ok(native, lengths, rules.window)
    accept = native | (candidates & ~_low_entropy(logits[:, :k], candidates, rules))
    accepted = accept.long().cumprod(1).sum(1)

    emitted = target_choice.gather(1, accepted[:, None]).squeeze(1)
    if sampled is not None:
        rows = sampled.rows
        emitted[rows] = sampled.emit(accepted[rows])
    columns = torch.arange(k + 1, device=device)
    tokens = torch.cat([drafts, drafts.new_zeros(batch, 1)], 1)
    tokens = torch.where(columns < accepted[:, None], tokens, PAD_TOKEN)
    tokens.scatter_(1, accepted[:, None], emitted[:, None])
    loose = accept & ~native & (positions < accepted[:, None])
    return Verdict(accepted=accepted, tokens=tokens, native=native, loose=loose)


def target_entropy(logits: torch.Tensor, measure: str = "topk", top_k: int = 3) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim.

    "topk": -Σ p log p over the top_k probabilities of the full softmax (not renormalised),
    in nats. "full": the full-vocabulary entropy divided by log V (0..1).
    """
    vocab = logits.shape[-1]
    if measure == "topk":
        top_log_probs = logits.topk(min(top_k, vocab), -1).values - torch.logsumexp(logits, -1, keepdim=True)
        return torch.special.entr(top_log_probs.exp()).sum(-1)
    if measure == "full":
        return torch.special.entr(torch.softmax(logits, -1)).sum(-1) / (math.log(vocab) if vocab > 1 else 1.0)
    raise ValueError(f"unknown entropy measure {measure!r} (expected 'topk' or 'full')")


def _low_entropy(logits: torch.Tensor, candidates: torch.Tensor, rules: RowRules) -> torch.Tensor:
    """[B, K] bool: the gate rejects the candidate mismatch here (gate on and entropy below θ).

    The entropy is computed only at candidate positions (mismatches the window would accept),
    which are few, instead of over the whole [B, K, V] block.
    """
    threshold = rules.entropy_threshold.to(logits.device)[:, None].expand_as(candidates)
    gated = candidates & (threshold > GATE_OFF_AT)
    low = torch.zeros_like(candidates)
    if bool(gated.any()):
        entropy = target_entropy(_upcast(logits[gated]), rules.entropy_measure, rules.entropy_top_k)
        low[gated] = entropy < threshold[gated]
    return low


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """float32/float64 as they are; half precisions as float32 (for softmax and entropy)."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def _window_ok(native: torch.Tensor, lengths: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """[B, K] bool: native[i+1..i+W-1] all True and i < K_b - W (W=0: every i < K_b)."""
    batch, k = native.shape
    positions = torch.arange(k, device=native.device)
    misses = torch.where(native, k, positions)
    next_miss = misses.flip(1).cummin(1).values.flip(1)  # first non-native position >= i
    next_miss_after = torch.cat([next_miss[:, 1:], next_miss.new_full((batch, 1), k)], 1)
    native_run_after = next_miss_after - positions - 1  # native matches right after i
    w = window.to(native.device)[:, None]
    return (native_run_after >= w - 1) & (positions + w < lengths[:, None])


@dataclass
class _SampledRows:
    """The sampling rows of a batch: the target's draw at each of their positions, and which drafts it keeps."""

    rows: torch.Tensor  # [S] long: their indices in the batch
    draws: torch.Tensor  # [S, K+1] long: a sample of each position's distribution (temperature, filters)
    native: torch.Tensor  # [S, K] bool: the draft token is the draw (the rejection test of a point-mass draft)

    @classmethod
    def draw(
        cls, logits: torch.Tensor, drafts: torch.Tensor, valid: torch.Tensor, sampling: RowSampling | None
    ) -> _SampledRows | None:
        """Draw every sampling row's K+1 positions; None when no row samples."""
        if sampling is None:
            return None
        temperatures = sampling.temperature.tolist()
        picked = [b for b, t in enumerate(temperatures) if t > 0]
        if not picked:
            return None
        device, (_, k) = logits.device, drafts.shape
        rows = torch.tensor(picked, device=device)
        top_ps = sampling.top_p.tolist()
        probs = distributions(_upcast(logits.index_select(0, rows)), [temperatures[b] for b in picked],
                              [top_ps[b] for b in picked],
                              None if sampling.top_k is None else [sampling.top_k[b] for b in picked],
                              None if sampling.min_p is None else [sampling.min_p[b] for b in picked])
        positions = sampling.positions or [0] * len(temperatures)
        uniforms = [u for b in picked for u in _uniforms(sampling.seeds[b], positions[b], k + 1)]
        draws = _inverse_cdf(probs.flatten(0, 1), torch.tensor(uniforms, dtype=torch.float64, device=device))
        draws = draws.view(len(picked), k + 1)
        native = valid[rows] & (draws[:, :k] == drafts[rows])
        return cls(rows=rows, draws=draws, native=native)

    def emit(self, accepted: torch.Tensor) -> torch.Tensor:
        """[S] the draw after the kept prefix: at a rejected draft it differs from it (a sample of p_r without
        d_r), after a fully kept draft it is a sample of p_{K_b}."""
        return self.draws.gather(1, accepted[:, None]).squeeze(1)


def _uniforms(seed: int | None, start: int, count: int) -> list[float]:
    """`count` uniforms in [0, 1) for context positions start, start+1, …: each one a function of the seed and
    its position alone (torch's default generator when there is no seed)."""
    if seed is None:
        return torch.rand(count, dtype=torch.float64).tolist()
    return [random.Random(f"{seed}:{start + i}").random() for i in range(count)]


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[P] per row of probs [P, V] (non-negative, any positive total) the token whose cumulative mass first
    exceeds uniforms[p] of the total: a sample of the row, never a token of mass 0.

    In two steps with float64 sums, so no cumulative sum is written over the whole vocabulary: the block of
    `_INVERSION_BLOCK` tokens where the point falls, then the token inside it."""
    rows, vocab = probs.shape
    whole = vocab - vocab % _INVERSION_BLOCK
    sums = probs[:, :whole].reshape(rows, -1, _INVERSION_BLOCK).sum(-1, dtype=torch.float64)
    if whole < vocab:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True, dtype=torch.float64)], 1)
    block, within = _pick(sums, uniforms)
    columns = block[:, None] * _INVERSION_BLOCK + torch.arange(_INVERSION_BLOCK, device=probs.device)
    inside = probs.gather(1, columns.clamp(max=vocab - 1)).double().masked_fill_(columns >= vocab, 0.0)
    token, _ = _pick(inside, within)
    return block * _INVERSION_BLOCK + token


def _pick(masses: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of masses [P, N] (float64, non-negative, positive total): the first index whose cumulative mass
    exceeds uniforms[p] of the total (never one of mass 0), and where in that index's mass the point fell (a
    fraction: the uniform for a step inside it)."""
    cumulative = masses.cumsum(-1)
    total = cumulative[:, -1:]
    point = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cumulative, point, right=True)
    mass = masses.gather(1, index)
    within = ((point - (cumulative.gather(1, index) - mass)) / mass).clamp(min=0.0)
    return index.squeeze(1), within.squeeze(1)
