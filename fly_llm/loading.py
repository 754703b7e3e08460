"""A ready FLyEngine from a ModelSpec: loads the models, gets the policy's costs, builds the engine.

The one place where model loading (fly_llm.model.pair) meets the engine (fly_llm.decoding), with
fly_llm.policy_costs beside it, so that the engine itself knows nothing about where its models come from.
"""

from __future__ import annotations

import logging

from fly_llm.common.config import FLyConfig, ModelSpec
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.grammar import CACHE_BYTES, MAX_GRAMMAR_BYTES
from fly_llm.decoding.grammar_sandbox import WORKERS
from fly_llm.decoding.policy import AdaptivePolicy
from fly_llm.model.pair import load_models
from fly_llm.policy_costs import REMEASURE_ENV, policy_costs

log = logging.getLogger(__name__)


def load_engine(spec: ModelSpec | None = None, config: FLyConfig | None = None, *,
                measure_costs: bool = True, prefix_cache_mb: int = 0, prefill_chunk: int = 0,
                grammar_cache_mb: int = CACHE_BYTES >> 20, max_grammar_mb: int = MAX_GRAMMAR_BYTES >> 20,
                grammar_workers: int = WORKERS) -> FLyEngine:
    """Load the target/draft pair of `spec` (HF id, local dir, GGUF; default: the embedded pair).

    With `measure_costs` the adaptive policy's costs are those of these models on this machine
    (`fly_llm.policy_costs`: timed at the first start, a few seconds, then kept in the model cache)
    instead of the defaults. `prefix_cache_mb` and `prefill_chunk` are FLyEngine's prefix-cache
    budget (MiB, 0: off) and per-step prefill bound; `grammar_cache_mb` and `max_grammar_mb` its
    compiled-grammar cache budget and per-grammar cap (MiB), `grammar_workers` its grammar sandbox's processes.
    """
    loaded = load_models(spec or ModelSpec())
    policy = AdaptivePolicy(policy_costs(loaded)) if measure_costs else None
    if policy is not None and loaded.draft is not None:
        for stage in policy.model_stages_that_cannot_pay(config or FLyConfig()):
            log.warning("the %s's step costs %.2f of a target step here: too slow to beat plain decoding even at "
                        "acceptance 0.9, so FLy never runs it and drafts with the n-gram stage alone. Time the costs "
                        "again on a quiet machine (%s=1) or start with --draft none to free its memory",
                        stage.replace("_", " "), policy.costs.of(stage).step, REMEASURE_ENV)
    engine = FLyEngine(loaded.target, loaded.tokenizer, loaded.draft, config, context_window=loaded.context_window,
                       policy=policy, prefix_cache_bytes=prefix_cache_mb * 2**20, prefill_chunk=prefill_chunk,
                       grammar_cache_bytes=grammar_cache_mb * 2**20, max_grammar_bytes=max_grammar_mb * 2**20,
                       grammar_workers=grammar_workers)
    engine.target_name, engine.draft_name = loaded.target_name, loaded.draft_name
    return engine
