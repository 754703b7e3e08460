"""The FLy acceptance rule on hand-written tensors (fly_llm.decoding.verify)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fly_llm.common.config import FLyConfig
from fly_llm.decoding.distributions import distributions
from fly_llm.decoding.verify import PAD_TOKEN, RowRules, RowSampling, Verdict, _inverse_cdf, target_entropy, verify

VOCAB = 8


def round_logits(choices: list[int], confident: set[int] = frozenset(), vocab: int = VOCAB) -> torch.Tensor:
    """[len(choices), vocab] logits whose argmax at i is choices[i].

    Positions in `confident` are near one-hot (entropy ~0); the others are nearly flat
    (top-3 entropy ~0.8 nats), so the default entropy gate lets their mismatches through.
    """
    logits = torch.zeros(len(choices), vocab, dtype=torch.float64)
    for i, choice in enumerate(choices):
        logits[i, choice] = 30.0 if i in confident else 0.1
    return logits


def rules(*configs: FLyConfig) -> RowRules:
    return RowRules.from_configs(list(configs), "cpu")


def run(drafts: list[list[int]], logits: list[torch.Tensor], lengths: list[int], row_rules: RowRules,
        sampling: RowSampling | None = None) -> Verdict:
    return verify(torch.tensor(drafts), torch.stack(logits), torch.tensor(lengths), row_rules, sampling)


def emitted(verdict: Verdict, row: int = 0) -> list[int]:
    return verdict.tokens[row, : int(verdict.accepted[row]) + 1].tolist()


TARGET = [1, 2, 3, 4, 5, 6, 7]  # the target's choice at positions 0..6 (6 is the bonus position)


def with_mismatches(*positions: int) -> list[int]:
    """The draft for K=6: the target's choices except at `positions` (token 0 there)."""
    return [0 if i in positions else t for i, t in enumerate(TARGET[:6])]


# --- the greedy rule -------------------------------------------------------------------------

def test_window_accepts_a_mismatch_followed_by_w_minus_1_native_matches():
    v = run([with_mismatches(1)], [round_logits(TARGET)], [6], rules(FLyConfig(window=3)))
    assert int(v.accepted[0]) == 6
    assert emitted(v) == [1, 0, 3, 4, 5, 6, 7]  # the draft's token kept at 1, then the bonus
    assert v.loose[0].tolist() == [False, True, False, False, False, False]
    assert v.native[0].tolist() == [True, False, True, True, True, True]


def test_window_rejects_a_mismatch_without_w_minus_1_following_matches():
    # mismatch at 1, then only one native match (2) before the next mismatch (3): W=3 needs two.
    v = run([with_mismatches(1, 3)], [round_logits(TARGET)], [6], rules(FLyConfig(window=3)))
    assert int(v.accepted[0]) == 1
    assert emitted(v) == [1, 2]
    assert not v.loose.any()


@pytest.mark.parametrize("position, accepted", [(2, True), (3, False), (4, False), (5, False)])
def test_the_last_w_positions_are_strict(position, accepted):
    # K=6, W=3: positions 3, 4, 5 (i >= K - W) are strict even when what follows matches.
    v = run([with_mismatches(position)], [round_logits(TARGET)], [6], rules(FLyConfig(window=3)))
    assert int(v.accepted[0]) == (6 if accepted else position)
    assert bool(v.loose[0, position]) == accepted


def test_window_one_accepts_every_mismatch_but_the_last_position():
    # W=1 needs no following matches: consecutive mismatches pass, position K-1 is strict.
    v = run([with_mismatches(0, 1, 2)], [round_logits(TARGET)], [6], rules(FLyConfig(window=1)))
    assert int(v.accepted[0]) == 6
    v = run([with_mismatches(0, 5)], [round_logits(TARGET)], [6], rules(FLyConfig(window=1)))
    assert int(v.accepted[0]) == 5
    assert emitted(v) == [0, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("measure, threshold", [("topk", 0.3), ("full", 0.2)])
def test_entropy_gate_rejects_a_low_entropy_mismatch(measure, threshold):
    config = FLyConfig(window=3, entropy_threshold=threshold, entropy_measure=measure)
    v = run([with_mismatches(1)], [round_logits(TARGET, confident={1})], [6], rules(config))
    assert int(v.accepted[0]) == 1
    assert emitted(v) == [1, 2]
    gate_off = config.model_copy(update={"entropy_threshold": 0.01})
    v = run([with_mismatches(1)], [round_logits(TARGET, confident={1})], [6], rules(gate_off))
    assert int(v.accepted[0]) == 6


def test_the_first_rejected_position_emits_the_targets_token():
    v = run([with_mismatches(2, 3)], [round_logits(TARGET)], [6], rules(FLyConfig(window=3)))
    assert int(v.accepted[0]) == 2
    assert v.tokens[0].tolist() == [1, 2, 3] + [PAD_TOKEN] * 4


def test_all_accepted_emits_the_bonus_token():
    v = run([TARGET[:6]], [round_logits(TARGET)], [6], rules(FLyConfig(loose=False)))
    assert int(v.accepted[0]) == 6
    assert v.tokens[0].tolist() == TARGET
    assert v.native[0].all() and not v.loose.any()


def test_loose_off_is_the_exact_prefix_rule():
    v = run([with_mismatches(1)], [round_logits(TARGET)], [6], rules(FLyConfig(loose=False, window=3)))
    assert int(v.accepted[0]) == 1
    assert emitted(v) == [1, 2]


def test_window_zero_accepts_every_mismatch_that_passes_the_gate():
    # Mismatches everywhere, including the last position: all accepted with W=0 ...
    v = run([with_mismatches(0, 1, 2, 5)], [round_logits(TARGET)], [6], rules(FLyConfig(window=0)))
    assert int(v.accepted[0]) == 6
    assert v.loose[0].tolist() == [True, True, True, False, False, True]
    # ... except where the target is confident.
    sure_at_2 = round_logits(TARGET, confident={2})
    v = run([with_mismatches(0, 1, 2, 5)], [sure_at_2], [6], rules(FLyConfig(window=0)))
    assert int(v.accepted[0]) == 2
    assert emitted(v) == [0, 0, 3]


def test_ragged_draft_lengths_including_plain_decoding():
    logits = [round_logits(TARGET)] * 3
    drafts = [TARGET[:6], [1, 2, -7, 10**6, 0, 0], [PAD_TOKEN] * 6]  # padding past a row's length is ignored
    v = run(drafts, logits, [6, 2, 0], rules(*[FLyConfig(window=0)] * 3))
    assert v.accepted.tolist() == [6, 2, 0]
    assert emitted(v, 0) == TARGET
    assert emitted(v, 1) == [1, 2, 3]  # the target's token at position 2 is this row's bonus
    assert emitted(v, 2) == [1]  # length 0: emit the target's argmax
    assert v.tokens[2].tolist() == [1] + [PAD_TOKEN] * 6
    assert not v.native[1, 2:].any() and not v.native[2].any() and not v.loose.any()


def test_rows_follow_their_own_rules_in_one_batch():
    flat, confident = round_logits(TARGET), round_logits(TARGET, confident={1})
    cases = [  # (rule, logits, kept draft tokens) for the draft with mismatches at 1 and 4
        (FLyConfig(loose=False), flat, 1),
        (FLyConfig(window=3), flat, 4),  # 1 loosely accepted, 4 strict
        (FLyConfig(window=4), flat, 1),  # 1 needs native 2..4
        (FLyConfig(window=3), confident, 1),  # the gate rejects 1
        (FLyConfig(window=3, entropy_threshold=0.0), confident, 4),
        (FLyConfig(window=0), flat, 6),
    ]
    drafts = [with_mismatches(1, 4)] * len(cases)
    batched = run(drafts, [z for _, z, _ in cases], [6] * len(cases), rules(*[c for c, _, _ in cases]))
    assert batched.accepted.tolist() == [kept for _, _, kept in cases]
    for row, (config, logits, _) in enumerate(cases):
        alone = run(drafts[:1], [logits], [6], rules(config))
        assert emitted(batched, row) == emitted(alone)
        assert batched.loose[row].tolist() == alone.loose[0].tolist()


def test_empty_round_and_bfloat16_logits():
    logits = round_logits(TARGET[:1]).to(torch.bfloat16)[None]
    v = verify(torch.zeros(1, 0, dtype=torch.long), logits, torch.tensor([0]), rules(FLyConfig()))
    assert v.tokens.tolist() == [[1]] and v.accepted.tolist() == [0]
    assert v.native.shape == (1, 0) and v.loose.shape == (1, 0)


def test_from_configs_needs_one_entropy_measure():
    with pytest.raises(ValueError, match="entropy measure"):
        rules(FLyConfig(), FLyConfig(entropy_measure="full"))
    stacked = rules(FLyConfig(window=2, entropy_threshold=0.5), FLyConfig(loose=False))
    assert stacked.loose.tolist() == [True, False]
    assert stacked.window.tolist() == [2, 6]
    assert stacked.entropy_threshold.tolist() == pytest.approx([0.5, 0.3])


def test_target_entropy_measures():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    expected_top3 = -sum(p * math.log(p) for p in (0.5, 0.25, 0.125))
    assert float(target_entropy(probs.log())) == pytest.approx(expected_top3)
    assert float(target_entropy(probs.log(), top_k=1)) == pytest.approx(-0.5 * math.log(0.5))
    assert float(target_entropy(torch.zeros(16), "full")) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        target_entropy(torch.zeros(4), "renyi")


# --- property test against a plain per-row reference ------------------------------------------

def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    return [e / sum(exps) for e in exps]


def _entropy(row: list[float], measure: str, top_k: int) -> float:
    probs = _softmax(row)
    if measure == "full":
        return -sum(p * math.log(p) for p in probs if p > 0) / math.log(len(row))
    return -sum(p * math.log(p) for p in sorted(probs, reverse=True)[:top_k] if p > 0)


def reference(draft, logits, length, config: FLyConfig):
    """The rule for one row, spelled out: (accepted, emitted tokens, native, loose)."""
    argmax = [row.index(max(row)) for row in logits]
    k = len(draft)
    native = [i < length and argmax[i] == draft[i] for i in range(k)]
    accept = []
    for i in range(length):
        in_window = i < length - config.window and all(native[i + 1:i + config.window])
        entropy = _entropy(logits[i], config.entropy_measure, config.entropy_top_k)
        gate_open = config.entropy_threshold <= 0.01 or entropy >= config.entropy_threshold
        accept.append(native[i] or (config.loose and in_window and gate_open))
    r = next((i for i, ok in enumerate(accept) if not ok), length)
    loose = [i < r and accept[i] and not native[i] for i in range(k)]
    return r, draft[:r] + [argmax[r]], native, loose


@st.composite
def rounds(draw):
    batch, k, vocab = draw(st.integers(1, 4)), draw(st.integers(0, 8)), draw(st.integers(2, 6))
    logits = draw(st.lists(st.lists(st.lists(st.integers(-3, 3), min_size=vocab, max_size=vocab),
                                    min_size=k + 1, max_size=k + 1), min_size=batch, max_size=batch))
    lengths = draw(st.lists(st.integers(0, k), min_size=batch, max_size=batch))
    drafts = []
    for row, length in zip(logits, lengths):
        draft = []
        for i in range(k):
            if i >= length:
                draft.append(draw(st.sampled_from([PAD_TOKEN, 0, 10**6])))
            elif draw(st.booleans()):
                draft.append(row[i].index(max(row[i])))
            else:
                draft.append(draw(st.integers(0, vocab - 1)))
        drafts.append(draft)
    measure = draw(st.sampled_from(["topk", "full"]))
    top_k = draw(st.integers(1, 4))
    configs = [FLyConfig(loose=draw(st.booleans()), window=draw(st.integers(0, 9)),
                         entropy_threshold=draw(st.sampled_from([0.0, 0.005, 0.2, 0.3, 0.6, 1.0])),
                         entropy_measure=measure, entropy_top_k=top_k) for _ in range(batch)]
    return drafts, logits, lengths, configs


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_matches_the_per_row_reference(case):
    drafts, logits, lengths, configs = case
    for row, config in zip(logits, configs):  # keep clear of entropies that sit on the threshold
        entropies = [_entropy(z, config.entropy_measure, config.entropy_top_k) for z in row]
        assume(all(abs(h - config.entropy_threshold) > 1e-9 for h in entropies))
    k = len(drafts[0])
    v = verify(torch.tensor(drafts, dtype=torch.long).reshape(len(drafts), k),
               torch.tensor(logits, dtype=torch.float64), torch.tensor(lengths), rules(*configs))
    for b, config in enumerate(configs):
        r, tokens, native, loose = reference(drafts[b], logits[b], lengths[b], config)
        assert int(v.accepted[b]) == r
        assert emitted(v, b) == tokens
        assert v.tokens[b, r + 1:].tolist() == [PAD_TOKEN] * (k - r)
        assert v.native[b].tolist() == native
        assert v.loose[b].tolist() == loose


# --- sampling ---------------------------------------------------------------------------------

def sampling_for(temperatures: list[float], seeds: list[int | None], top_p: float = 1.0) -> RowSampling:
    return RowSampling(torch.tensor(temperatures), torch.full((len(seeds),), top_p), seeds)


def test_same_seed_same_result_whatever_the_batch():
    torch.manual_seed(0)
    for seed in range(20):
        mine = torch.randn(5, VOCAB, dtype=torch.float64) * 2
        draft = mine[:4].argmax(-1).tolist()
        draft[1] = (draft[1] + 1) % VOCAB
        alone = run([draft], [mine], [4], rules(FLyConfig(window=2)), sampling_for([0.9], [seed]))
        # In a wider batch (K=6) between a seeded sampling row and a greedy row.
        others = torch.randn(2, 7, VOCAB, dtype=torch.float64)
        wide = torch.cat([mine, torch.randn(2, VOCAB, dtype=torch.float64)])
        batched = run([[0] * 6, draft + [3, 3], [1] * 6], [others[0], wide, others[1]], [6, 4, 6],
                      rules(FLyConfig(), FLyConfig(window=2), FLyConfig()),
                      sampling_for([1.0, 0.9, 0.0], [seed + 1, seed, None]))
        assert emitted(batched, 1) == emitted(alone)
        assert batched.native[1, :4].tolist() == alone.native[0].tolist()
        assert batched.loose[1, :4].tolist() == alone.loose[0].tolist()


def test_greedy_rows_stay_greedy_in_a_sampling_batch():
    drafts, logits = [with_mismatches(1), with_mismatches(3)], [round_logits(TARGET)] * 2
    greedy = run(drafts, logits, [6, 6], rules(FLyConfig(window=3), FLyConfig(window=3)))
    mixed = run(drafts, logits, [6, 6], rules(FLyConfig(window=3), FLyConfig(window=3)),
                sampling_for([0.0, 1.0], [None, 7]))
    assert emitted(mixed, 0) == emitted(greedy, 0)
    assert mixed.loose[0].tolist() == greedy.loose[0].tolist()


def test_sampling_keeps_a_loosely_accepted_draft_token():
    # Position 1's draft lies outside the top-p nucleus (rejected for sure), the target is
    # uncertain there, and the next position matches for sure: FLy keeps the draft token.
    logits = torch.zeros(5, 4, dtype=torch.float64)
    logits[1] = torch.tensor([0.3, 0.2, 0.1, -0.5])  # draft token 3 is the least likely
    logits[[0, 2, 3, 4], [0, 1, 2, 1]] = 40.0
    draft = [0, 3, 1, 2]
    loose = run([draft], [logits], [4], rules(FLyConfig(window=2)), sampling_for([1.0], [3], top_p=0.6))
    assert emitted(loose) == [0, 3, 1, 2, 1]
    assert loose.loose[0].tolist() == [False, True, False, False]
    exact = run([draft], [logits], [4], rules(FLyConfig(loose=False)), sampling_for([1.0], [3], top_p=0.6))
    assert int(exact.accepted[0]) == 1 and int(exact.tokens[0, 1]) in (0, 1)


def target_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> list[float]:
    """softmax(logits / T) restricted to the top-p nucleus, written out by hand."""
    probs = torch.softmax(logits / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda j: -probs[j])
    kept, mass = set(), 0.0
    for j in order:
        if mass >= top_p:
            break
        kept.add(j)
        mass += probs[j]
    return [probs[j] / mass if j in kept else 0.0 for j in range(len(probs))]


def total_variation(samples: list[int], expected: list[float]) -> float:
    counts = [samples.count(j) / len(samples) for j in range(len(expected))]
    return 0.5 * sum(abs(c - e) for c, e in zip(counts, expected))


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_exact_sampling_preserves_the_target_distribution(temperature, top_p):
    # V=5, K=2, 20k independent rounds in one batch: the first emitted token must follow p_0,
    # and the second one, given the first draft token was kept, must follow p_1 (the biased
    # 'sample without removing the rejected draft' variant is off by a total variation of ~0.23).
    n = 20_000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 0.2], [0.0, 1.2, 0.4, 0.4, -1.0], [0.3, 0.0, 0.0, 0.9, 0.1]],
                          dtype=torch.float64)
    draft = [0, 2]  # kept about a third of the time, so both branches of the test run
    torch.manual_seed(1234)
    v = verify(torch.tensor([draft] * n), logits.expand(n, -1, -1), torch.full((n,), 2),
               rules(*[FLyConfig(loose=False)] * n),
               RowSampling(torch.full((n,), temperature), torch.full((n,), top_p), [None] * n))
    first = v.tokens[:, 0].tolist()
    assert total_variation(first, target_distribution(logits[0], temperature, top_p)) < 0.025
    kept = v.accepted >= 1
    assert 0.2 < kept.float().mean() < 0.6
    second = v.tokens[kept, 1].tolist()
    assert total_variation(second, target_distribution(logits[1], temperature, top_p)) < 0.04


@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0])  # nucleus: most of the vocabulary ... a few tokens
def test_top_p_nucleus_matches_a_sorted_cumulative_sum(scale):
    torch.manual_seed(5)
    logits = torch.randn(2, 3, 1000, dtype=torch.float64) * scale
    probs = distributions(logits.clone(), [0.7, 1.3], [0.9, 0.5])
    for row, (temperature, top_p) in enumerate([(0.7, 0.9), (1.3, 0.5)]):
        for position in range(3):
            expected = target_distribution(logits[row, position], temperature, top_p)
            assert probs[row, position].tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("temperature,top_p", [(1e-40, 1.0), (5e-324, 1.0), (1.0, 5e-324), (0.5, 1e-46),
                                               (1e-40, 1e-46)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_at_float_edges_is_greedy(temperature, top_p, dtype):
    """Issue 45: a temperature that overflows logits / T (or underflows to 0) gave NaN probabilities and
    token 0; a top_p that underflows to 0 made the nucleus index -1 and raised. Their limit is greedy."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 40) * 4).to(dtype)
    drafts = logits[:, :4].float().argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % 40  # one mismatch: the row's correction is sampled too
    n = len(drafts)
    row_rules = rules(*[FLyConfig(loose=False)] * n)
    greedy = verify(drafts, logits, torch.full((n,), 4), row_rules)
    sampled = verify(drafts, logits, torch.full((n,), 4), row_rules,
                     RowSampling(torch.full((n,), temperature), torch.full((n,), top_p),
                                 list(range(n))))
    assert sampled.tokens.tolist() == greedy.tokens.tolist()


@pytest.mark.parametrize("vocab", [5, 1024, 5000])
def test_a_draw_by_blocks_is_the_plain_inversion_and_never_a_token_of_mass_0(vocab):
    """`_inverse_cdf` finds the block, then the token in it: the same token as one cumulative sum over the
    whole row, for uniforms from 0 to just below 1, with runs of zero mass (a whole block of them, a row whose
    only mass is its last token, a one-hot)."""
    torch.manual_seed(vocab)
    probs = torch.rand(4, vocab) * (torch.rand(4, vocab) < 0.3)
    probs[1, : vocab // 2] = 0.0
    probs[2] = 0.0
    probs[2, -1] = 0.5
    probs[3] = torch.nn.functional.one_hot(torch.tensor(vocab // 3), vocab)
    for uniform in [0.0, 1e-12, 0.25, 0.5, 0.999, 1 - 2 ** -53, *torch.rand(40).tolist()]:
        uniforms = torch.full((4,), uniform, dtype=torch.float64)
        drawn = _inverse_cdf(probs, uniforms)
        cumulative = probs.double().cumsum(-1)
        total = cumulative[:, -1:]
        point = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        assert drawn.tolist() == torch.searchsorted(cumulative, point, right=True).squeeze(1).tolist()
        assert bool((probs.gather(1, drawn[:, None]) > 0).all())
