"""Validated settings shared by the engine, the daemon and the clients (no torch here)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 16
"""Most stop strings one request may give (beyond: TOO_LONG)."""
MAX_STOP_CHARS = 256
"""Longest stop string, in characters (beyond: TOO_LONG)."""
MAX_TOP_K = 1_000_000
"""Largest top_k a request may give (a top_k at or over the vocabulary keeps every token)."""
MAX_REPETITION_PENALTY = 10.0
"""Largest repetition_penalty a request may give (llama.cpp and Ollama take any positive value; past a few it
only forbids repeats)."""
DRAFT_STAGES: tuple[str, ...] = ("ngram", "draft_model")
"""The draft stages, in cascade order (upstream first); fly_llm.decoding.stages registers each."""


class _Settings(BaseModel):
    """Base: unknown fields are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FLyConfig(_Settings):
    """Speculation settings (docs/design.md §1). `loose=False` is exact, lossless SPD."""

    k: int = Field(15, ge=1, le=64, description="Upper bound on draft tokens per round.")
    window: int = Field(6, ge=0, le=64, description="Deferred window W; 0 accepts any gated mismatch.")
    entropy_threshold: float = Field(
        0.3, ge=0.0, le=20.0, description="Entropy gate θ in nats; <= 0.01 disables the gate."
    )
    entropy_measure: Literal["topk", "full"] = Field(
        "topk", description="'topk': -Σ p log p over the top-k of the full softmax; 'full': full-vocab entropy / log V."
    )
    entropy_top_k: int = Field(3, ge=1, le=1000, description="Probabilities the 'topk' entropy sums over.")
    loose: bool = Field(True, description="FLy's loose acceptance on; off = exact speculative decoding.")
    stages: tuple[str, ...] = Field(
        DRAFT_STAGES, description="The draft stages to run, of DRAFT_STAGES ('draft_model' when one is loaded); "
                                  "the cascade runs them in its own order; () is target-only decoding.")
    max_ngram: int = Field(4, ge=1, le=16, description="Longest n-gram the lookup stage matches in the context.")
    ngram_tokens: int = Field(6, ge=1, le=64, description="Tokens one n-gram proposal copies.")
    recent_answers: int = Field(
        8192, ge=0, le=1 << 20, description="Tokens of recent answers (each request's own cache scope's) the "
                                            "n-gram stage also copies from, all scopes together; 0: off.")
    draft_confidence: float = Field(
        0.0, ge=0.0, le=1.0, description="Stop a row's draft-model drafting after a token the draft model gives "
                                         "less than this probability (0: off). Drafts only: exact mode stays exact.")
    adaptive: bool = Field(True, description="Adapt K and the stages per request from acceptance history.")

    @model_validator(mode="before")
    @classmethod
    def _stage_switches(cls, data: Any) -> Any:
        """The older switches `ngram=False` and `draft_model=False` drop that stage from `stages`."""
        if not isinstance(data, dict) or not {"ngram", "draft_model"} & data.keys():
            return data
        data = dict(data)
        off = {name for name in ("ngram", "draft_model") if name in data and not data.pop(name)}
        data["stages"] = tuple(s for s in data.get("stages", DRAFT_STAGES) if s not in off)
        return data

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, stages: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(stages) - set(DRAFT_STAGES))
        if unknown:
            raise ValueError(f"unknown draft stage(s) {unknown}; the stages are {list(DRAFT_STAGES)}")
        if len(set(stages)) < len(stages):
            raise ValueError("a draft stage is named twice")
        return tuple(s for s in DRAFT_STAGES if s in stages)  # cascade order


class FLyOverrides(_Settings):
    """Per-request overrides of the daemon's FLyConfig; None keeps the daemon's value."""

    k: int | None = Field(None, ge=1, le=64)
    window: int | None = Field(None, ge=0, le=64)
    entropy_threshold: float | None = Field(None, ge=0.0, le=20.0)
    loose: bool | None = None

    def apply(self, base: FLyConfig) -> FLyConfig:
        """Return `base` with the fields set here replaced."""
        return base.model_copy(update=self.model_dump(exclude_none=True))


class SamplingParams(_Settings):
    """How one request is decoded. temperature 0 is greedy.

    The samplers, in the order they apply (docs/design.md §1.6): the penalties (repetition, presence,
    frequency, over the last `repeat_last_n` context tokens) change the target's logits, greedy rows too;
    then temperature, top_k, top_p and min_p shape the distribution a sampling row draws from (greedy:
    the filters keep the argmax, so they change nothing)."""

    max_tokens: int = Field(256, ge=1, le=1_000_000)
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="Sample among the k most likely tokens only; 0: off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description=(
        "Drop tokens less likely than min_p times the most likely one (after temperature); 0: off."))
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY, description=(
        "Divide a repeated token's positive logit by this, multiply a negative one (Ollama's repeat_penalty, "
        "CTRL's rule); 1: off."))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "Subtract this from a repeated token's logit once (OpenAI's range); 0: off."))
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "Subtract this times a token's repeat count from its logit (OpenAI's range); 0: off."))
    repeat_last_n: int = Field(64, ge=-1, le=1_000_000, description=(
        "The penalties count the last this many tokens of the context, prompt and output (Ollama's and "
        "llama.cpp's window); -1: the whole context; 0: the penalties are off."))
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] = Field(default_factory=list,
                                                                         max_length=MAX_STOP_STRINGS)

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: list[str]) -> list[str]:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        return stop


REQUEST_OPTIONS: tuple[str, ...] = (*SamplingParams.model_fields, *FLyOverrides.model_fields)
"""The options one request may set, declared once as the fields of SamplingParams and FLyOverrides
(fly_llm.common.options.build_options, the LangChain and LlamaIndex adapters take exactly these names)."""


Quantization = Literal["auto", "none", "w4a8", "int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
"""Weight quantization choices for the target and the draft (fly_llm.model.quantization; docs/models.md)."""


DraftWeights = Literal["published", "rounded"]
DRAFT_WEIGHTS: tuple[str, ...] = get_args(DraftWeights)
"""How the draft's weights are stored under w4a8 (fly_llm.model.pair; docs/models.md)."""


class ModelSpec(_Settings):
    """Which models to load and where. target None = the embedded default pair."""

    target: str | None = Field(None, description="HF id, local directory or .gguf file; None = embedded default.")
    draft: str | None = Field(
        None, description="HF id, local dir or .gguf; None = the default pair's draft; 'none' = n-gram only."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        "auto", description="The models' float type ('auto': bfloat16 where the GPU or CPU has it natively, else float16 on a GPU, float32 on a CPU).")
    device: str = Field("auto", description="'auto', 'cpu', 'cuda', 'cuda:1', …")
    device_map: str | None = Field(None, description="Passed to accelerate, e.g. 'auto' to spread over GPUs.")
    target_quantization: Quantization = Field(
        "auto", description="quantized target weights ('auto': w4a8 on an x86 CPU with AVX2 or AVX-512 VNNI, else "
                            "int8 where torch has the kernels; float on GPU). Exact mode reproduces the target as it runs, "
                            "quantized or not.")
    draft_quantization: Quantization = Field(
        "auto", description="quantized draft weights ('auto': as for the target). "
                            "The draft only proposes, so it changes speed, never what exact mode emits.")
    draft_weights: DraftWeights = Field(
        "published", description="how the draft's Linear weights are stored under w4a8: 'published' as the file has "
                                 "them, or 'rounded' to the kernel's 4-bit layout for a cheaper step (a GGUF draft's "
                                 "5- and 8-bit blocks too). The draft only proposes, so it changes speed, never what "
                                 "exact mode emits.")
    draft_vocabulary: int = Field(
        0, ge=0, description="the draft's output head scores only this many tokens (the special ones and the "
                             "most frequent: fly_llm.model.draft_vocabulary); 0: all. The draft only proposes, "
                             "so it changes speed, never what exact mode emits.")
