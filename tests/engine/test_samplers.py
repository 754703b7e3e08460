"""top_k, min_p and the repetition / presence / frequency penalties against plain-Python references
(fly_llm.decoding.distributions, fly_llm.decoding.penalties), and inside verify with mixed rows."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.distributions import distributions
from fly_llm.decoding.penalties import Penalty, window_counts
from fly_llm.decoding.verify import RowRules, RowSampling, verify


def reference_distribution(logits: list[float], temperature: float, top_k: int, top_p: float,
                           min_p: float) -> list[float]:
    """softmax(z / T), then top-k (ties with the k-th kept), top-p (smallest prefix reaching the mass, ties
    with its last kept), min-p (at least min_p × the largest), renormalised after each, written out by hand."""
    top = max(logits)
    weights = [math.exp((z - top) / temperature) for z in logits]
    probs = [w / sum(weights) for w in weights]

    def keep(kept: set[int]) -> list[float]:
        mass = sum(probs[j] for j in kept)
        return [probs[j] / mass if j in kept else 0.0 for j in range(len(probs))]

    order = sorted(range(len(probs)), key=lambda j: -probs[j])
    if 0 < top_k < len(probs):
        edge = probs[order[top_k - 1]]
        probs = keep({j for j in order if probs[j] >= edge})
    if top_p < 1.0:
        kept, mass = set(), 0.0
        for j in order:
            if mass >= top_p:
                break
            kept.add(j)
            mass += probs[j]
        edge = min(probs[j] for j in kept)
        probs = keep({j for j in order if probs[j] >= edge})
    if min_p > 0.0:
        edge = min_p * max(probs)
        probs = keep({j for j in order if probs[j] >= edge})
    return probs


def reference_penalized(logits: list[float], history: list[int], penalty: Penalty) -> list[float]:
    """llama.cpp's penalties over the last `last_n` tokens of `history` (-1: all), by hand."""
    window = history if penalty.last_n < 0 else history[max(0, len(history) - penalty.last_n):]
    counts = Counter(window)
    out = []
    for token, z in enumerate(logits):
        c = counts[token]
        if c:
            z = (z / penalty.repetition if z > 0 else z * penalty.repetition) - c * penalty.frequency - penalty.presence
        out.append(z)
    return out


ROW = st.tuples(st.sampled_from([0.3, 1.0, 1.7]), st.sampled_from([0, 1, 2, 5, 40, 1000]),
                st.sampled_from([1.0, 0.9, 0.5]), st.sampled_from([0.0, 0.05, 0.3, 1.0]))
"""(temperature, top_k, top_p, min_p) of one row; top_k 1000 is past the vocabulary (off)."""


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(ROW, min_size=1, max_size=4), seed=st.integers(0, 2**16), scale=st.sampled_from([0.5, 3.0]))
def test_filters_match_the_reference_row_by_row_in_mixed_batches(rows, seed, scale):
    torch.manual_seed(seed)
    logits = torch.randn(len(rows), 3, 50, dtype=torch.float64) * scale
    temperatures, top_ks, top_ps, min_ps = (list(column) for column in zip(*rows))
    probs = distributions(logits.clone(), temperatures, top_ps, top_ks, min_ps)
    for b, (temperature, top_k, top_p, min_p) in enumerate(rows):
        for position in range(3):
            expected = reference_distribution(logits[b, position].tolist(), temperature, top_k, top_p, min_p)
            assert probs[b, position].tolist() == pytest.approx(expected, abs=1e-12)


def test_top_k_keeps_ties_and_min_p_keeps_the_top_token_at_one():
    logits = torch.tensor([[[2.0, 1.0, 1.0, 1.0, 0.0, -1.0]]] * 2, dtype=torch.float64)
    probs = distributions(logits.clone(), [1.0, 1.0], [1.0, 1.0], [2, 0], [0.0, 1.0])
    assert (probs[0, 0] > 0).tolist() == [True, True, True, True, False, False]  # the 2nd is tied with 2 more
    assert probs[1, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_filters_at_their_off_values_change_nothing():
    torch.manual_seed(3)
    logits = torch.randn(2, 2, 30, dtype=torch.float64)
    plain = distributions(logits.clone(), [0.8, 1.2], [1.0, 0.7])
    assert torch.equal(distributions(logits.clone(), [0.8, 1.2], [1.0, 0.7], [0, 30], [0.0, 0.0]), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filters_at_float_edges_keep_the_greedy_token(dtype):
    """A temperature near 0 with top_k 1 / min_p 1: one token, the argmax, never an empty distribution."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 4, 40) * 4).to(dtype)
    probs = distributions(logits.float().clone(), [1e-40, 1.0, 5e-324], [1.0, 1.0, 1e-46], [1, 0, 3], [0.0, 1.0, 0.5])
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.float().argmax(-1))
    assert probs.sum(-1).sub(1).abs().max() < 1e-5


# --- penalties ----------------------------------------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 7), max_size=12)


@settings(max_examples=200, deadline=None)
@given(context=TOKENS, drafts=st.lists(st.integers(0, 7), max_size=5), last_n=st.integers(-1, 9),
       padding=st.integers(0, 2))
def test_window_counts_per_position_match_a_counter(context, drafts, last_n, padding):
    """Position i counts the last `last_n` tokens of context + drafts[:i]: the drafts a round keeps before it."""
    positions = len(drafts) + 1 + padding
    ids, counts = window_counts(context, drafts, last_n, positions)
    for i in range(positions):
        history = context + drafts[:i]
        window = history if last_n < 0 else history[max(0, len(history) - last_n):] if last_n else []
        expected = Counter(window)
        got = {int(t): int(c) for t, c in zip(ids, counts[i]) if c}
        assert got == dict(expected)


PENALTY = st.builds(Penalty, st.sampled_from([1.0, 0.5, 1.3, 3.0]), st.sampled_from([0.0, -2.0, 0.7]),
                    st.sampled_from([0.0, 2.0, -0.4]), st.sampled_from([-1, 1, 3, 64]))


@settings(max_examples=150, deadline=None)
@given(penalty=PENALTY, context=st.lists(st.integers(0, 7), min_size=1, max_size=12),
       drafts=st.lists(st.integers(0, 7), max_size=4), seed=st.integers(0, 2**16))
def test_penalties_match_the_reference_at_every_position(penalty, context, drafts, seed):
    torch.manual_seed(seed)
    logits = torch.randn(len(drafts) + 1, 8, dtype=torch.float64) * 3
    logits[0, 1] = 0.0
    logits[-1, 2] = -math.inf  # a grammar-masked token stays masked
    penalized = logits.clone()
    penalty.apply_(penalized, context, drafts)
    for i in range(len(drafts) + 1):
        expected = reference_penalized(logits[i].tolist(), context + drafts[:i], penalty)
        assert penalized[i].tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiny_repetition_penalty_keeps_logits_finite_and_their_order(dtype):
    """Issue 65: repetition_penalty 1e-40 (in range) turned a repeated token's positive logit into inf, and sampling
    over inf failed the request (500). It is the largest finite logit instead; the distribution is a distribution."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]], dtype=dtype)
    Penalty(1e-40, 0.0, 0.0, -1).apply_(logits, [0, 1], [])
    assert torch.isfinite(logits).all() and logits[0, 0] == torch.finfo(dtype).max and logits[0, 1] <= 0
    probs = distributions(logits.float()[None].clone(), [1.0], [1.0], [0], [0.0])
    assert torch.isfinite(probs).all() and probs.argmax(-1).item() == 0 and abs(probs.sum().item() - 1) < 1e-5


@pytest.mark.parametrize("settings_, off", [
    (dict(), True), (dict(repetition_penalty=1.1), False), (dict(presence_penalty=-0.5), False),
    (dict(frequency_penalty=0.2, repeat_last_n=0), True), (dict(frequency_penalty=0.2, repeat_last_n=-1), False),
])
def test_a_request_has_a_penalty_only_when_it_changes_something(settings_, off):
    assert (Penalty.of(SamplingParams(**settings_)) is None) == off


@pytest.mark.parametrize("bad", [dict(top_k=-1), dict(min_p=1.5), dict(min_p=-0.1), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=-3), dict(repetition_penalty=0), dict(repetition_penalty=11),
                                 dict(repeat_last_n=-2), dict(min_p=math.nan), dict(presence_penalty=math.inf),
                                 dict(top_k=1.5)])
def test_out_of_range_samplers_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# --- in verify: rows with different filters sample from their own distributions -------------------------------

def test_exact_sampling_follows_each_rows_filtered_distribution_in_one_batch():
    """V=6, K=1, three kinds of rows interleaved in one batch of 24k: plain, top_k 2, min_p 0.4. Each row's
    first token follows its own filtered distribution, whether the draft was kept or the residual sampled."""
    n, kinds = 24_000, [(0, 0.0), (2, 0.0), (0, 0.4)]
    logits = torch.tensor([[1.0, 0.6, 0.0, -0.5, 0.3, 0.9], [0.0, 1.2, 0.4, 0.4, -1.0, 0.1]], dtype=torch.float64)
    draft = [1]  # the 3rd most likely: top_k 2 cuts it (always rejected there), the others keep it at times
    top_ks = [kinds[b % 3][0] for b in range(n)]
    min_ps = [kinds[b % 3][1] for b in range(n)]
    torch.manual_seed(99)
    v = verify(torch.tensor([draft] * n), logits.expand(n, -1, -1), torch.ones(n, dtype=torch.long),
               RowRules.from_configs([FLyConfig(loose=False)] * n, "cpu"),
               RowSampling(torch.ones(n), torch.ones(n), [None] * n, top_ks, min_ps))
    first = v.tokens[:, 0].tolist()
    for kind, (top_k, min_p) in enumerate(kinds):
        samples = first[kind::3]
        expected = reference_distribution(logits[0].tolist(), 1.0, top_k, 1.0, min_p)
        frequencies = [samples.count(j) / len(samples) for j in range(6)]
        assert 0.5 * sum(abs(f - e) for f, e in zip(frequencies, expected)) < 0.02, (kind, frequencies, expected)
