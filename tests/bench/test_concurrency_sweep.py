"""benchmarks.engine.concurrency_sweep keeps c requests in flight through one engine and reports each method's
aggregate tokens per second against target-only's of the same round."""

from __future__ import annotations

from benchmarks.engine.concurrency_sweep import RowByRow, report, serve
from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.policy import AdaptivePolicy, PolicyState, RowAsk
from fly_llm.decoding.stages import DraftModelStage, NgramStage
from support.tiny_models import make_pair


def test_every_prompt_is_served_in_flight_at_most_c_at_a_time_with_the_same_tokens():
    target, draft, tokenizer = make_pair("llama")
    engine = FLyEngine(target, tokenizer, draft, FLyConfig(loose=False))
    prompts = [tokenizer.encode(text) for text in ("a b c", "hello world", "the cat", "x", "one two three")]
    batch_sizes = []
    step = engine.step

    def counted():
        batch_sizes.append(engine.num_active)
        return step()

    engine.step = counted
    fly = serve(engine, prompts, 2, 12, FLyConfig(loose=False))
    first = len(batch_sizes)
    plain = serve(engine, prompts, 5, 12, FLyConfig(loose=False, stages=()))
    assert fly["tokens"] == plain["tokens"] == sum(  # exact mode: every answer is the target's greedy one
        len(g.token_ids) for g in engine.generate([tokenizer.decode(p) for p in prompts],
                                                  SamplingParams(max_tokens=12, temperature=0.0)))
    assert max(batch_sizes[:first]) == 2 and max(batch_sizes[first:]) == 5
    assert plain["drafted"] == 0 and fly["accepted_native"] <= fly["drafted"]


def test_a_base_policy_without_plan_round_plans_each_row_at_the_batchs_size():
    policy = AdaptivePolicy()
    asks = [RowAsk(PolicyState(), FLyConfig(), 100, (NgramStage, DraftModelStage)) for _ in range(3)]
    wrapped = RowByRow(policy)
    assert wrapped.plan_round(asks) == [policy.plan(PolicyState(), FLyConfig(), 100, 3, a.offered) for a in asks]
    assert wrapped.costs is policy.costs


def test_the_report_gives_each_method_over_target_only_of_the_same_round():
    rows = [{"round": 0, "in_flight": 2, "method": "plain", "tokens": 100, "seconds": 10.0, "model_rounds": 0,
             "ngram_rounds": 0, "drafted": 0, "accepted_native": 0, "accepted_loose": 0},
            {"round": 0, "in_flight": 2, "method": "fly", "tokens": 100, "seconds": 8.0, "model_rounds": 3,
             "ngram_rounds": 4, "drafted": 20, "accepted_native": 9, "accepted_loose": 1}]
    text = report(rows, ["fly"], ["# sweep"])
    assert "| 2 | fly | 12.50 | 1.250 | 3 | 4 | 10 / 20 | 10.0% |" in text
