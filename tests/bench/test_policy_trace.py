"""benchmarks.engine.policy_trace records every engine round of a FLy request with its plan and outcome, and
leaves the engine as it found it."""

from __future__ import annotations

import torch
from support.tiny_models import make_pair

from benchmarks.harness.methods import Runner, all_methods
from benchmarks.engine.policy_trace import PLAIN_ENGINE, summary, trace


def test_every_round_is_traced_and_the_engine_is_restored():
    target, draft, tokenizer = make_pair("llama")
    runner = Runner(target, tokenizer, draft, max_tokens=24)
    prompt = tokenizer.encode("def add(a, b):\n    return a + b\n" * 3 + "def add(")
    rounds, run = trace(runner, all_methods()["fly"], prompt, 24)
    assert len(rounds) == run.stats.rounds and all(r.seconds > 0 for r in rounds)
    assert sum(r.accepted for r in rounds) + len(rounds) >= len(run.token_ids)  # each round emits kept + 1
    assert {r.kind for r in rounds} <= {"plain", "ngram", "model", "probe"}
    kinds = summary(rounds)
    assert kinds["base_ms"][1] > 0 and sum(n for kind, (n, _, _) in kinds.items() if kind != "base_ms") == len(rounds) - 1
    assert summary(rounds[:1]) == {}  # an answer of one round has nothing to compare
    assert "plan" not in vars(runner.engine.policy) and "step" not in vars(runner.engine)  # unpatched
    with torch.inference_mode():
        assert runner.run(PLAIN_ENGINE, prompt, 24).token_ids  # the engine still decodes
