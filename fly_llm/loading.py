"""A ready FLyEngine from a ModelSpec: loads the models, times the policy's costs, builds the engine.

The one place where model loading (fly_llm.model.pair) meets the engine (fly_llm.decoding), so that
the engine itself knows nothing about where its models come from.
"""

from __future__ import annotations

from fly_llm.common.config import FLyConfig, ModelSpec
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.policy import AdaptivePolicy, Costs
from fly_llm.model.pair import load_models


def load_engine(spec: ModelSpec | None = None, config: FLyConfig | None = None, *,
                measure_costs: bool = True, prefix_cache_mb: int = 0, prefill_chunk: int = 0) -> FLyEngine:
    """Load the target/draft pair of `spec` (HF id, local dir, GGUF; default: the embedded pair).

    With `measure_costs` the adaptive policy's costs are timed on these models once, here
    (`Costs.measure`, a few seconds), instead of taken from the defaults. `prefix_cache_mb` and
    `prefill_chunk` are FLyEngine's prefix-cache budget (MiB, 0: off) and per-step prefill bound.
    """
    loaded = load_models(spec or ModelSpec())
    policy = AdaptivePolicy(Costs.measure(loaded.target, loaded.draft)) if measure_costs else None
    engine = FLyEngine(loaded.target, loaded.tokenizer, loaded.draft, config, context_window=loaded.context_window,
                       policy=policy, prefix_cache_bytes=prefix_cache_mb * 2**20, prefill_chunk=prefill_chunk)
    engine.target_name, engine.draft_name = loaded.target_name, loaded.draft_name
    return engine
