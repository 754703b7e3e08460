"""Adaptive drafting (docs/design.md §1.4): per request and round, how many tokens to draft and with which stages.

`FLyConfig.k` is an upper bound. From each request's own history the policy estimates, per
stage (by name: `PolicyState.lookups`, `PolicyState.models`), the chance α that the target agrees
with the next draft token (native acceptance), and, for model-stage rounds (the only ones FLy
loosens: `DraftPlan.may_loosen`), the chance ρ that
FLy's rule rescues a native mismatch at a position where the rule may act (a position with at
least W draft tokens after it: the last W are strict); lookup (n-gram) rounds are valued with ρ = 0. It
picks the plan with the highest expected tokens per unit of time:

    tokens(K) = 1 + Σ_{j=1..K} Π_{i<j} a_i,   a_i = α + (1-α)·ρ where i < K-W, else α
    time      = 1 + verify(K)  (+ s·K·d(1/s) when the draft model runs),   verify(K) = B·(c(B+K) − c(B))

in units of one plain target forward, with c(w) a target forward over w new tokens (`Costs.target`:
timed at a few widths, since it is not linear: on a CPU a forward is memory-bound up to a few
tokens, so verifying 4 costs little more than 1, and compute-bound beyond), B the batch size (a
longer verify forward delays every row, so a big batch speculates less), s the request's measured
draft-model forwards per drafted token (1 for the model alone, less in the n-gram → model cascade when
the copies hold) and d(w) a draft-model forward over w new tokens (`StageCost.forward`, timed at a few
widths like the target's: a forward that checks an n-gram copy feeds ~1/s tokens; a lookup stage costs
nothing). With the
loose rule off ρ = 0 and tokens(K) is the geometric 1 + α + … + α^K. So with FLy on, plans with
K > W, where the deferred window can act, are valued by what FLy accepts; ρ starts from an
optimistic prior, so such plans are tried while a request has no history, and ρ then follows what
the rule really rescued. Plain decoding (K = 0, time 1, one token) is always a candidate, so a plan
is only chosen when it is expected to beat target-only decoding. n-gram proposals are nearly free,
so n-gram rounds run whenever they are expected to pay: a lookup that finds nothing drafts nothing
(a plain round), so its share of hits h weighs both sides, (1 + h·gain) / (1 + h·verify(K)),
and a falling hit rate cannot lock the lookup out (its hit rate is only learned when it runs); the
draft model runs only when its acceptance is high enough to pay for its forwards. A stage that is
not chosen is re-tried now and then with a short draft (its probe interval grows fourfold while it
keeps losing), so the estimate can recover when the text changes; but only where a round of it at an
optimistic acceptance (0.9) would be chosen, i.e. beat the best other plan by the margin below: a probe
that cannot lead to a model round is its catch-up and forwards for nothing. (With the draft step timed
at 0.65 of the target's, the embedded pair's model could not win even at 0.9, and its two probes a
request held FLy to 1.00× target-only on MT-Bench prose, 1.07× without them: benchmarks/results/policy-probe.)

A model round is only chosen when it is expected to beat the best other plan by `_MODEL_MARGIN`
(10%): the costs are timed on other shapes than the round's (a few widths, 64 cached tokens) and
acceptance over a few tokens is noisy, so rounds expected to gain less are coin flips that cost the
draft's forwards. Measured on MT-Bench prose (embedded pair, w4a8, 2 AVX-512 threads): one-token model
rounds, valued at 1.0–1.1× plain by the acceptance their request had shown, took 1.65 plain steps each
(the model's 1.61) and emitted 1.6 tokens.

The draft model must also pay in fact: per request, the tokens its rounds emitted and their time
(`1 + verify(drafted) + forwards·d(drafted/forwards)`, with the forwards the round really took, a
catch-up counted as one whatever its pieces) are kept as decayed sums, and once it has run, it is
chosen only while those rounds yielded more tokens per unit of time than the best other plan is
expected to. Acceptance
estimated over a few tokens is noisy, and choosing the model whenever the estimate is high picks
its lucky streaks: on general prose the model rounds so chosen emitted 2.2 tokens in the time of
2.8 plain steps (measured, embedded pair, int8, bf16, 2 threads), each of them a loss.

A model round first feeds the draft cache what it lacks of the context (`PolicyState.behind`:
the whole prompt in a request's first model round unless the prefix cache gave it, then the
tokens of the rounds since the model last ran). That catch-up costs
`draft_prefill · draft_behind` once, so a model plan other than a probe is valued over the tokens the
request is still expected to emit, L = min(max_tokens left, max(tokens emitted so far, 64)) — a
request that has run n tokens is taken to run about n more, and a new one 64:

    speed over L = L / (draft_prefill · draft_behind + L / speed of the round)

A probe cannot be valued that way: what a model that has not run yields (its n-gram-checked cascade
forwards, FLy's rescues) is what the probe finds out, and the optimistic estimate says "barely
better than plain" on the embedded pair, where the model then paid well on code and math. So a
probe's catch-up is bounded instead: at most a quarter of the time the rest of the request is
expected to take (L tokens at the best other plan's speed). A cold draft cache behind a long
prompt (a RAG question over retrieved passages: ~1,500 tokens of draft prefill, worth ~70 target
forwards on the embedded pair) is then never caught up for a short answer, nor before a long one
has run ~300 tokens; behind a prompt of up to ~300 tokens (HumanEval, GSM8K) the model is probed
early, as soon as the n-gram stage's estimate is below what a model round could win by the margin
(while the n-gram stage does better, an unproven model is not probed at all); a warm cache is valued
as before.

A batch's round is then priced as a whole (`AdaptivePolicy.plan_round`): the verify forward pads every row
to the longest draft, so a batch of B rows verifying up to K drafts costs c(B·(K+1)), not c(B + K); each
draft-model forward runs over all B rows and holds them all; a catch-up pads all B rows to the backlog
it feeds. Against a plain round (B tokens in c(B)) the round's expected tokens per unit of time are
compared for every cap on the rows' drafts (0: plain) and with the model rows on their best lookup plan
instead, and the best is run; a batch of one keeps its row's own plan. Each row's own plan above
weighs the batch only through verify(K) and cannot see that one row's long draft widens everyone's
forward: with 8 requests of prose in flight FLy served 0.92× target-only's tokens per second (issue 62, AMD
EPYC with AVX-512 VNNI; the sweep that measures it: benchmarks/results/concurrency).

Rounds are never timed: the costs are fixed (the defaults, or `Costs.measure` timed once per
machine and models and kept in the model cache: fly_llm.policy_costs), so the choices — and hence
FLy-mode output — depend only on the tokens.

With `FLyConfig.adaptive = False` every round drafts k tokens with the configured stages.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from fly_llm.common.config import FLyConfig
from fly_llm.decoding.cache import BatchKV
from fly_llm.decoding.stages import DraftModelStage, DraftPlan, Stage

PLAIN = DraftPlan(k=0)
_FIRST_PROBE = 8
_OPTIMISTIC_ALPHA = 0.9  # a model stage is only probed if it could win (by _MODEL_MARGIN) at this acceptance
_PREFILL_WIDTH = 128  # tokens of the timed catch-up forward (the daemon's default prefill chunk)
_DRAFT_WIDTHS = (1, 2, 4)  # new tokens of the timed draft forwards: a model step alone, cascade steps
_TIMED_WIDTHS = (1, 2, 4, 8, 16)  # new tokens of the timed target forwards
_PRIOR_TOKENS = 64  # what a request is expected to emit before its history says more
_PROBE_CATCH_UP_SHARE = 0.25  # a probe's catch-up may take this share of the request's expected remaining time
_PROBE_BACKOFF = 4  # a probe that lost multiplies the rounds until the next one by this
_MODEL_MARGIN = 0.1  # a model round must be expected to beat the best other plan by this share


@dataclass(frozen=True)
class StageCost:
    """What one drafter costs, in target forwards over one token: per forward over one new token
    (`step`) and per token of backlog it catches up on first (`prefill`). A lookup stage costs nothing.

    A forward over w new tokens (the model's own token plus an n-gram copy it checks) costs
    `forward(w)`: `widths` holds (w, cost in steps) pairs, w ≥ 2 rising, interpolated as the target's
    are (`Costs.target`); without them every forward costs one step.
    """

    step: float = 0.0
    prefill: float = 0.0
    widths: tuple[tuple[int, float], ...] = ()

    def forward(self, width: float) -> float:
        """A forward over `width` new tokens (at least one), in target forwards over one token."""
        return self.step * _interpolate([(1, 1.0), *self.widths], max(width, 1.0)) if self.widths else self.step

    @classmethod
    def from_dict(cls, data: Mapping) -> StageCost:
        """A StageCost from `dataclasses.asdict` of one (JSON turns its pairs into lists); an unknown field is a
        TypeError, as it was before the widths."""
        return cls(**{**data, "widths": tuple((int(w), float(c)) for w, c in data.get("widths", ()))})


@dataclass(frozen=True)
class Costs:
    """Relative costs, in units of one target forward over one token, per drafter by name.

    A target forward over w new tokens costs `target(w)`: between the timed widths of
    `target_widths` ((w, cost) pairs, w ≥ 2 rising) linear, beyond the last at its last segment's
    slope; without them 1 + target_token·(w − 1), the mean slope up to 16 tokens.

    Defaults measured on CPU with a 1.5B target / 0.5B draft in bf16: a target forward over 16
    tokens costs ≈ 1.1× one token; a draft-model forward ≈ 1/2.4 of a target forward. The draft
    prefills a token of its backlog for ≈ 1/20 of a target forward (measured 0.043–0.055 with the
    embedded pair in int8 on 2 AVX-512 threads).
    """

    target_token: float = 0.007
    stages: Mapping[str, StageCost] = field(
        default_factory=lambda: {DraftModelStage.name: StageCost(step=0.42, prefill=0.05)})
    target_widths: tuple[tuple[int, float], ...] = ()

    def of(self, stage: str) -> StageCost:
        """The cost of a drafter (nothing for one not listed)."""
        return self.stages.get(stage, StageCost())

    def with_stage(self, stage: str, **cost: float) -> Costs:
        """These costs with some fields of one drafter's cost replaced."""
        return replace(self, stages={**self.stages, stage: replace(self.of(stage), **cost)})

    def target(self, width: int) -> float:
        """A target forward over `width` new tokens, in one-token forwards."""
        return _interpolate([(1, 1.0), *(self.target_widths or [(2, 1.0 + self.target_token)])], width)

    def verify(self, drafted: int, batch_size: int = 1) -> float:
        """What verifying `drafted` tokens adds to a round of a batch of `batch_size` one-token rows,
        for the whole batch (each row waits for the longer forward)."""
        return batch_size * (self.target(batch_size + drafted) - self.target(batch_size))

    @classmethod
    def from_dict(cls, data: Mapping) -> Costs:
        """Costs from `dataclasses.asdict` of Costs, or from the flat form that results directories keep
        (`target_token`, `draft_step`, `draft_prefill`: the draft-model stage's step and prefill)."""
        widths = tuple((int(w), float(c)) for w, c in data.get("target_widths", ()))
        if "stages" in data:
            stages = {name: StageCost.from_dict(cost) for name, cost in data["stages"].items()}
            return cls(data["target_token"], stages, widths)
        default = cls().of(DraftModelStage.name)
        cost = StageCost(data.get("draft_step", default.step), data.get("draft_prefill", default.prefill))
        return cls(data.get("target_token", cls.target_token), {DraftModelStage.name: cost}, widths)

    @classmethod
    def measure(cls, target, draft=None, context: int = 64, repeats: int = 2, rounds: int = 5) -> Costs:
        """Time the models here (a few forwards on dummy tokens) instead of using the defaults.

        The target is timed over `_TIMED_WIDTHS` new tokens, the draft over `_DRAFT_WIDTHS` (its step
        alone is one new token; a cascade forward also checks an n-gram proposal) and over
        `_PREFILL_WIDTH`, a catch-up forward (per token); a width's cost is never below a narrower
        one's. (The draft's step was once timed over 4 new tokens: 1.1–1.3× its
        one-token forward on the embedded pair, so the draft model alone was charged ~0.6 of a target
        step instead of 0.43–0.48, and on a fresh install the policy never ran it.)
        The two take turns, `rounds` times (each width the fastest of `repeats` forwards in a round: one
        forward's hiccup is dropped), and every cost is a ratio within one round, to that round's one-token
        target forward, taken at its median over the rounds: a shared machine's speed drifts (a VM's memory
        bandwidth by ±30% within minutes), so forwards timed a second apart compare better than forwards
        timed seconds apart, and one fast or slow moment moves a median little. (Each forward's
        fastest time over all rounds counted before: the one-token forward's luckiest time set the unit, so
        a timing during which the machine's speed changed made every wider forward look dear — c(4) 1.37
        against the median's 1.19 in one of twenty timings back to back — and one timing of c(2) 1.24,
        c(4) 1.54 cost FLy a seventh of its GSM8K speed: benchmarks/results/policy-costs-timing.)
        The engine's choices then depend on this machine, so FLy-mode output can differ between
        machines, and between two timings on one (exact mode is lossless either way):
        fly_llm.policy_costs keeps the first.
        """
        draft_widths = (*_DRAFT_WIDTHS, _PREFILL_WIDTH)
        ratios = []  # per round: every timed forward over that round's one-token target forward
        for _ in range(rounds):
            timed = _forward_seconds(target, context, _TIMED_WIDTHS, repeats)
            if draft is not None:
                timed += _forward_seconds(draft, context, draft_widths, repeats)
            ratios.append([seconds / timed[0] for seconds in timed])
        median = [statistics.median(column) for column in zip(*ratios)]
        widths = _relative(_TIMED_WIDTHS, median[:len(_TIMED_WIDTHS)])
        target_token = (widths[-1][1] - 1) / (widths[-1][0] - 1)
        if draft is None:
            return cls(target_token=target_token, target_widths=widths)
        *steps, prefill = median[len(_TIMED_WIDTHS):]
        cost = StageCost(step=steps[0], prefill=prefill / _PREFILL_WIDTH, widths=_relative(_DRAFT_WIDTHS, steps))
        return cls(target_token, {DraftModelStage.name: cost}, widths)


@dataclass
class _Rate:
    """Decayed counts of successes and failures; `value` estimates the success probability.

    Per stage it is the native acceptance α (a kept native draft token vs a mismatch); shared, it
    is FLy's rescue rate ρ (a mismatch the rule kept vs one it could have kept but did not).
    """

    hits: float
    misses: float

    def update(self, hits: int, misses: int, decay: float) -> None:
        self.hits = self.hits * decay + hits
        self.misses = self.misses * decay + misses

    @property
    def value(self) -> float:
        return self.hits / (self.hits + self.misses)


@dataclass
class LookupHistory:
    """One request's history with a lookup stage: acceptance α and the decayed share of lookups that
    found a proposal."""

    alpha: _Rate = field(default_factory=lambda: _Rate(1.0, 1.0))
    hit: float = 0.5


@dataclass
class ModelHistory:
    """One request's history with a model stage."""

    alpha: _Rate = field(default_factory=lambda: _Rate(1.5, 1.0))
    steps: float = 1.0  # decayed model forwards per drafted token (< 1 when upstream proposals help)
    since: int = _FIRST_PROBE  # rounds since it last ran (a new request probes it at once; the engine
    # offers no model stage in a request's first round, so that is its second)
    probe_every: int = _FIRST_PROBE
    probing: bool = False  # the current round is a probe
    tokens: float = 0.0  # tokens emitted by its rounds, decayed per round it ran
    time: float = 0.0  # their decayed time, in plain target forwards (0: it never ran)

    @property
    def realized(self) -> float | None:
        """Tokens per unit of time that its rounds really yielded (None before the first)."""
        return self.tokens / self.time if self.time else None


@dataclass
class PolicyState:
    """One request's history per stage (by name), FLy's rescue rate, and how far each model stage's
    cache lags its context.

    `behind` is set by the engine before each plan: per model stage, the context tokens its cache
    lacks besides the last one (which every round feeds), i.e. what its round must prefill first.
    """

    lookups: dict[str, LookupHistory] = field(default_factory=dict)
    models: dict[str, ModelHistory] = field(default_factory=dict)
    rescue: _Rate = field(default_factory=lambda: _Rate(0.5, 0.5))  # optimistic: try K > W early
    emitted: int = 0  # tokens its rounds emitted so far (forced grammar tokens aside)
    behind: dict[str, int] = field(default_factory=dict)

    def lookup(self, stage: str) -> LookupHistory:
        """The history with a lookup stage (fresh the first time)."""
        return self.lookups.setdefault(stage, LookupHistory())

    def model(self, stage: str) -> ModelHistory:
        """The history with a model stage (fresh the first time)."""
        return self.models.setdefault(stage, ModelHistory())


@dataclass(frozen=True)
class RowAsk:
    """What one row's round is planned from: its history, its FLy settings, the tokens it may still draft
    (`budget`) and the drafters the engine offers it (in cascade order)."""

    state: PolicyState
    fly: FLyConfig
    budget: int
    offered: Sequence[Stage]


class AdaptivePolicy:
    """Chooses each request's DraftPlan from its acceptance history and the batch size; its `costs` are
    fixed for its life (the module docstring says why)."""

    def __init__(self, costs: Costs = Costs(), decay: float = 0.9, max_probe_every: int = 256) -> None:
        self.costs = costs
        self.decay = decay
        self.max_probe_every = max_probe_every
        self._verify: dict[tuple[int, int], tuple[float, ...]] = {}  # (k_max, batch size) -> verify costs

    def model_stages_that_cannot_pay(self, fly: FLyConfig) -> list[str]:
        """The model stages whose round, for a request alone, cannot beat plain decoding by the margin even at
        the optimistic acceptance and FLy's prior rescue rate: the policy never probes or chooses them,
        whatever the text (their step is too slow for these costs)."""
        verify = self._verify_costs(fly.k, 1)
        loose = _Loose(PolicyState().rescue.value, fly.window) if fly.loose else _Loose()
        return [name for name, cost in self.costs.stages.items()
                if cost.step and not _could_win(verify, cost.step, loose, best_speed=1.0)]

    def _verify_costs(self, k_max: int, batch_size: int) -> tuple[float, ...]:
        """`Costs.verify` for K in 0..k_max at this batch size: fixed by the costs, so computed once per
        (k_max, batch size) rather than every row's every round (half of a plan's time otherwise)."""
        key = (k_max, batch_size)
        if key not in self._verify:
            self._verify[key] = tuple(self.costs.verify(k, batch_size) for k in range(k_max + 1))
        return self._verify[key]

    def plan(self, state: PolicyState, fly: FLyConfig, budget: int, batch_size: int,
             offered: Sequence[Stage]) -> DraftPlan:
        """The plan for one round among the `offered` drafters (in cascade order) that `fly.stages`
        enables; `budget` caps k (tokens the request may still draft)."""
        stages = [s for s in offered if s.name in fly.stages]
        k_max = min(fly.k, budget)
        if k_max <= 0 or not stages:
            return PLAIN
        lookups = tuple(s.name for s in stages if not s.runs_model)
        models = [s.name for s in stages if s.runs_model]
        if not fly.adaptive:
            return DraftPlan(k=k_max, stages=tuple(s.name for s in stages), model=stages[-1].runs_model)
        verify = self._verify_costs(k_max, batch_size)
        best, best_speed = PLAIN, 1.0
        for name in lookups:
            history = state.lookup(name)
            k, gain = _best_k(history.alpha.value, verify, 0.0)  # lookup rounds are verified exactly
            # a miss drafts nothing: a plain round, so the hit rate weighs the verify's cost as well as its gain
            speed = (1 + history.hit * gain) / (1 + history.hit * verify[k])
            if speed > best_speed:
                best, best_speed = DraftPlan(k=k, stages=(name,)), speed
        round_ = _Round(budget, verify, _Loose(state.rescue.value, fly.window) if fly.loose else _Loose())
        for name in models:
            plan = self._model_plan(state, name, lookups, round_, best_speed)
            if plan is not None:
                return plan
        return best

    def plan_round(self, asks: Sequence[RowAsk]) -> list[DraftPlan]:
        """Every row's plan for one round of a batch of `len(asks)` rows: each row's own (`plan`), then the
        round priced at the batch's real width (`_round_speed`) and the drafting capped where that pays
        more tokens per unit of time: at most `cap` drafts in each adaptive row (0: a plain round), with or
        without the draft model. A batch of one keeps its row's own plan."""
        batch = len(asks)
        plans = [self.plan(a.state, a.fly, a.budget, batch, a.offered) for a in asks]
        if batch == 1 or not any(p.k and a.fly.adaptive for a, p in zip(asks, plans)):
            return plans  # a fixed plan (`FLyConfig.adaptive` off) is the request's to choose, not the batch's
        options = [plans]
        if any(p.model and a.fly.adaptive for a, p in zip(asks, plans)):  # the model rows on their best lookup plan
            options.append([self.plan(a.state, a.fly, a.budget, batch, [s for s in a.offered if not s.runs_model])
                            if p.model and a.fly.adaptive else p for a, p in zip(asks, plans)])
        best, best_speed = plans, 0.0
        for option in options:
            for cap in range(max(p.k for p in option) + 1):
                capped = [(replace(p, k=cap) if cap else PLAIN) if a.fly.adaptive and p.k > cap else p
                          for a, p in zip(asks, option)]
                speed = self._round_speed(asks, capped)
                if speed > best_speed:
                    best, best_speed = capped, speed
        for ask, before, after in zip(asks, plans, best):
            if before.model and not after.model:  # a probe that does not run is not a probe
                ask.state.model(before.drafter).probing = False
        return best

    def _round_speed(self, asks: Sequence[RowAsk], plans: Sequence[DraftPlan]) -> float:
        """Expected tokens per unit of time (one-token target forwards) of a round of these plans, priced at
        the batch's real width: the verify forward pads every row to the longest draft (B·(K+1) tokens,
        c(B) when no row drafts), each draft-model forward runs over all B rows and holds the whole batch,
        and a catch-up pads all B rows to the backlog it feeds (its share for this round's tokens)."""
        batch = len(plans)
        tokens, quiet, draft, catch_up = 0.0, 1.0, 0.0, 0.0
        for ask, plan in zip(asks, plans):
            gain, drafts = self._expected_gain(ask, plan)
            tokens += 1 + gain
            if plan.k:
                quiet *= 1 - drafts
            if plan.model:
                history, cost = ask.state.model(plan.drafter), self.costs.of(plan.drafter)
                draft = max(draft, plan.k * history.steps * cost.forward(batch))
                expected = min(ask.budget + 1, max(ask.state.emitted, _PRIOR_TOKENS))
                catch_up += cost.prefill * batch * ask.state.behind.get(plan.drafter, 0) * (1 + gain) / expected
        widest = max(p.k for p in plans)
        verify = quiet * self.costs.target(batch) + (1 - quiet) * self.costs.target(batch * (widest + 1))
        return tokens / (verify + draft + catch_up)

    @staticmethod
    def _expected_gain(ask: RowAsk, plan: DraftPlan) -> tuple[float, float]:
        """(expected draft tokens kept, chance that the row drafts at all) of `plan` for this row."""
        if not plan.k:
            return 0.0, 0.0
        if plan.model:
            loose = _Loose(ask.state.rescue.value, ask.fly.window) if ask.fly.loose else _Loose()
            return _gain(ask.state.model(plan.drafter).alpha.value, plan.k, loose), 1.0
        history = ask.state.lookup(plan.drafter)
        return history.hit * _gain(history.alpha.value, plan.k), history.hit

    def _model_plan(self, state: PolicyState, name: str, upstream: tuple[str, ...], round_: _Round,
                    best_speed: float) -> DraftPlan | None:
        """A round of model stage `name` (with the lookups upstream) if it beats `best_speed` or is due a
        probe, else None."""
        history, cost, k_max = state.model(name), self.costs.of(name), len(round_.verify) - 1
        draft_per_token = history.steps * cost.forward(1 / history.steps)
        expected = min(round_.budget + 1, max(state.emitted, _PRIOR_TOKENS))
        catch_up = _CatchUp(cost.prefill * state.behind.get(name, 0), expected)
        realized = history.realized
        paid = realized is None or realized > best_speed
        expected_speed = catch_up.over(_speed(history.alpha.value, round_.verify, draft_per_token, round_.loose))
        if paid and expected_speed > best_speed * (1 + _MODEL_MARGIN):
            k, _ = _best_k(history.alpha.value, round_.verify, draft_per_token, round_.loose)
            return DraftPlan(k=k, stages=(*upstream, name), model=True)
        could_win = _could_win(round_.verify, draft_per_token, round_.loose, best_speed)  # else no probe can pay
        could_win = could_win and catch_up.cost <= _PROBE_CATCH_UP_SHARE * catch_up.tokens / best_speed
        if could_win and history.since >= history.probe_every:
            history.probing = True
            return DraftPlan(k=min(4, k_max), stages=(*upstream, name), model=True)
        return None

    def observe(self, state: PolicyState, plan: DraftPlan, drafted: int, accepted: int,
                forwards: int = 0, *, loose: int = 0, window: int | None = None,
                batch_size: int = 1) -> None:
        """Learn from one round's outcome.

        `accepted` counts every kept draft token, `loose` those FLy's rule kept although the target
        disagreed; `window` is the round's W when the loose rule was on (None: off, so the round
        says nothing about ρ, nor does a round that may not loosen: a lookup round);
        `forwards` is how many model forwards the round took, in a batch of `batch_size`.
        """
        if window is not None and drafted and plan.may_loosen:
            rejected_where_eligible = accepted < drafted - window
            state.rescue.update(loose, rejected_where_eligible, self.decay)
        native, misses = accepted - loose, loose + (accepted < drafted)
        state.emitted += accepted + 1
        for name, history in state.models.items():
            if not (plan.model and name == plan.drafter):
                history.since += 1
        if plan.model:
            history = state.model(plan.drafter)
            history.alpha.update(native, misses, self.decay)
            cost = self.costs.of(plan.drafter)
            draft_time = forwards * cost.forward(drafted / forwards) if forwards else 0.0
            round_time = 1 + self.costs.verify(drafted, batch_size) + draft_time
            history.tokens = history.tokens * self.decay + accepted + 1
            history.time = history.time * self.decay + round_time
            if drafted:
                history.steps = history.steps * self.decay + (1 - self.decay) * forwards / drafted
            history.probe_every = (min(_PROBE_BACKOFF * history.probe_every, self.max_probe_every)
                                   if history.probing else _FIRST_PROBE)
            history.probing, history.since = False, 0
        elif plan.drafter is not None:
            history = state.lookup(plan.drafter)
            history.hit = history.hit * self.decay + (1 - self.decay) * (drafted > 0)
            if drafted:
                history.alpha.update(native, misses, self.decay)


@dataclass(frozen=True)
class _Round:
    """What every plan of one round is bounded and valued by."""

    budget: int
    verify: tuple[float, ...]  # per K in 0..k_max: what verifying K draft tokens adds (`Costs.verify`)
    loose: _Loose


@dataclass(frozen=True)
class _Loose:
    """What FLy's rule adds to a plan: rescue chance ρ at positions with ≥ W drafts after them."""

    rho: float = 0.0
    window: int = 0


@dataclass(frozen=True)
class _CatchUp:
    """A model round's one-off draft prefill (`cost`, in target forwards), spread over the `tokens`
    the request is still expected to emit."""

    cost: float
    tokens: int

    def over(self, speed: float) -> float:
        """Tokens per unit of time over the expected rest of the request at `speed` after the catch-up."""
        return self.tokens / (self.cost + self.tokens / speed)


def _could_win(verify: Sequence[float], draft_per_token: float, loose: _Loose, best_speed: float) -> bool:
    """Whether a model round at the optimistic acceptance would be chosen over a plan of `best_speed` (beat it by
    the margin): if not, no probe of the model can lead to a model round."""
    return _speed(_OPTIMISTIC_ALPHA, verify, draft_per_token, loose) > best_speed * (1 + _MODEL_MARGIN)


def _speed(alpha: float, verify: Sequence[float], draft_per_token: float, loose: _Loose = _Loose()) -> float:
    """Expected tokens per unit of time at the best K."""
    k, gain = _best_k(alpha, verify, draft_per_token, loose)
    return (1 + gain) / (1 + verify[k] + draft_per_token * k)


def _best_k(alpha: float, verify: Sequence[float], draft_per_token: float,
            loose: _Loose = _Loose()) -> tuple[int, float]:
    """The K in 1..len(verify)-1 with the best (expected extra tokens) / time, and those extra tokens;
    a round's time is 1 + verify[K] + draft_per_token·K."""
    best_k, best_gain, best_speed = 1, 0.0, 0.0
    for k in range(1, len(verify)):
        gain = _gain(alpha, k, loose)
        speed = (1 + gain) / (1 + verify[k] + draft_per_token * k)
        if speed > best_speed:
            best_k, best_gain, best_speed = k, gain, speed
    return best_k, best_gain


def _gain(alpha: float, k: int, loose: _Loose = _Loose()) -> float:
    """Expected draft tokens kept of k at native acceptance α, FLy's rule rescuing mismatches at the
    positions with at least W drafts after them."""
    rescued = alpha + (1 - alpha) * loose.rho
    m = max(k - loose.window, 0)  # positions where the rule may rescue a mismatch
    return _geometric(rescued, m) + rescued ** m * _geometric(alpha, k - m)


def _interpolate(points: Sequence[tuple[float, float]], width: float) -> float:
    """The cost at `width` from (width, cost) points, widths rising: linear between them, beyond the last at
    its last segment's slope."""
    (w0, c0), (w1, c1) = next(((a, b) for a, b in zip(points, points[1:]) if width <= b[0]), points[-2:])
    return c0 + (c1 - c0) * (width - w0) / (w1 - w0)


def _relative(widths: Sequence[int], timed: Sequence[float]) -> tuple[tuple[int, float], ...]:
    """(width, cost) for the widths after the first, in units of the first's timed forward (`timed`: seconds,
    or costs in any one unit), each at least the narrower one's (a timing that came out cheaper for more tokens
    is noise)."""
    pairs, cost = [], 1.0
    for width, forward in zip(widths[1:], timed[1:]):
        cost = max(cost, forward / timed[0])
        pairs.append((width, cost))
    return tuple(pairs)


def _geometric(x: float, n: int) -> float:
    """x + x² + … + xⁿ."""
    return n if x == 1 else x * (1 - x ** n) / (1 - x)


@torch.inference_mode()
def _forward_seconds(model, context: int, widths: tuple[int, ...], repeats: int) -> list[float]:
    """Per width q: the fastest of `repeats` forwards over q new tokens after `context` cached ones."""
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    kv = BatchKV.prefill(model, list(range(context)), device)
    best = [float("inf")] * len(widths)
    for r in range(repeats + 1):  # the first round warms up
        for i, q in enumerate(widths):
            tokens = torch.arange(q, device=device)[None]
            sync()
            start = time.perf_counter()
            kv.forward(model, tokens, logits_to_keep=q)
            sync()
            if r:
                best[i] = min(best[i], time.perf_counter() - start)
            kv.truncate([context])
    return best
