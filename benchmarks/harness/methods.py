"""The decoding methods compared by fly-bench, and running one prompt with one of them.

All methods decode greedily from the same prompt token ids with the same models in the same
process: Hugging Face `generate` (target only, assisted generation with the draft, prompt lookup),
our FLyEngine with per-request FLyConfig variants (exact SPD, FLy defaults, ablations) and,
optionally, llama.cpp (`llama-cpp-python`) decoding the target's GGUF file on its own.
Tokens per target forward (MAT) is counted the same way for every torch method, by a forward hook
on the target's decoder; llama.cpp decodes one token per forward.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import torch
from transformers.generation.streamers import BaseStreamer

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.common.stats import RequestStats
from fly_llm.common.tool_formats import Constraints
from fly_llm.common.tools import Structure

PROMPT_LOOKUP_TOKENS = 10


@dataclass(frozen=True)
class Method:
    """A named way to decode: HF `generate` with extra kwargs, or FLyEngine with a FLyConfig."""

    name: str
    description: str
    kind: Literal["hf", "engine", "llamacpp"]
    hf_kwargs: dict[str, Any] = field(default_factory=dict)
    fly: FLyConfig | None = None
    float_weights: bool = False  # HF generate on the unquantized target (what quantization costs)
    flash_attn: bool = False  # llama.cpp with flash attention (its own default on a CPU; llama-cpp-python's is off)

    def settings(self) -> dict[str, Any]:
        """JSON-ready description of what this method runs."""
        if self.kind == "engine":
            return {"engine": "FLyEngine", "fly": self.fly.model_dump()}
        if self.kind == "llamacpp":
            return {"engine": "llama-cpp-python", "version": package_version("llama-cpp-python"), "greedy": True,
                    "flash_attn": self.flash_attn}
        return {"engine": "transformers.generate", **({"weights": "float"} if self.float_weights else {}),
                **{k: ("<draft model>" if k == "assistant_model" else v) for k, v in self.hf_kwargs.items()}}


def _fly_variants() -> list[Method]:
    base = FLyConfig()
    variants = [
        Method("spd", "our exact speculative decoding (cascade on, FLy off)", "engine",
               fly=base.model_copy(update={"loose": False})),
        Method("fly", "FLy with the default settings", "engine", fly=base),
    ]
    ablations = [(f"fly-w{w}", f"FLy, deferred window W={w}", {"window": w}) for w in (0, 1, 2, 4, 6)] + [
        ("fly-no-gate", "FLy, entropy gate off", {"entropy_threshold": 0.0}),
        *[(f"fly-w1-gate{theta}", f"FLy, W=1 with a stricter entropy gate θ={theta}",
           {"window": 1, "entropy_threshold": theta}) for theta in (0.5, 0.7)],
        ("fly-model-only", "FLy, cascade off: draft model only, no n-gram stage", {"stages": ("draft_model",)}),
        ("fly-ngram-only", "FLy, n-gram stage only, no draft model", {"stages": ("ngram",)}),
        ("fly-fixed-k8", "FLy, adaptive policy off: K=8 every round", {"adaptive": False, "k": 8}),
        ("fly-fixed-k15", "FLy, adaptive policy off: K=15 every round", {"adaptive": False, "k": 15}),
        ("fly-confidence", "FLy, draft model stops at a token it gives < 0.4 (HF's default)",
         {"draft_confidence": 0.4}),
    ]
    for name, description, update in ablations:
        config = base.model_copy(update=update)
        if config != base:  # an ablation equal to the defaults is method "fly" itself
            variants.append(Method(name, description, "engine", fly=config))
    return variants


HF_METHODS = ["target", "assisted", "lookup"]
TARGET_FLOAT = "target-float"
MAIN_METHODS = HF_METHODS + ["spd", "fly", TARGET_FLOAT]
LLAMACPP = "llamacpp"
LLAMACPP_FLASH = "llamacpp-flash-attn"


def llamacpp_installed() -> bool:
    """Whether llama-cpp-python (method (f), optional) can be imported."""
    return importlib.util.find_spec("llama_cpp") is not None


def default_methods() -> list[str]:
    """The methods of a plain run: (a)–(e), plus llama.cpp where llama-cpp-python is installed."""
    return MAIN_METHODS + ([LLAMACPP] if llamacpp_installed() else [])


def all_methods() -> dict[str, Method]:
    """Every method by name: (a)–(e) first, then the ablations."""
    methods = [
        Method("target", "target only, greedy (HF generate)", "hf"),
        Method(TARGET_FLOAT, "target only, greedy (HF generate), unquantized weights: what quantization costs",
               "hf", float_weights=True),
        Method("assisted", "HF assisted generation with the same draft", "hf",
               {"assistant_model": "draft"}),
        Method("lookup", f"HF prompt-lookup decoding ({PROMPT_LOOKUP_TOKENS} tokens)", "hf",
               {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}),
        *_fly_variants(),
        Method(LLAMACPP, "llama.cpp target only, greedy, on the target's GGUF file (its own quantised kernels), "
               "flash attention off (llama-cpp-python's default)", "llamacpp"),
        Method(LLAMACPP_FLASH, "llama.cpp target only, greedy, on the target's GGUF file, flash attention on "
               "(llama.cpp's and llama-server's default on a CPU)", "llamacpp", flash_attn=True),
    ]
    return {m.name: m for m in methods}


@dataclass
class Run:
    """One prompt decoded by one method."""

    token_ids: list[int]
    seconds: float
    ttft: float
    target_forwards: int
    stats: RequestStats | None = None


class _FirstToken(BaseStreamer):
    """Streamer that records when `generate` hands out its first new token."""

    def __init__(self) -> None:
        self.calls = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.at is None:  # call 1 is the prompt
            self.at = time.perf_counter()

    def end(self) -> None:
        """Nothing to flush."""


class Runner:
    """Runs methods on prompt token ids with one loaded target/draft pair (and engine, lazily)."""

    def __init__(self, target: torch.nn.Module, tokenizer: Any, draft: torch.nn.Module | None,
                 max_tokens: int, context_window: int | None = None, target_gguf: Path | None = None,
                 float_target: torch.nn.Module | None = None, policy: Any = None) -> None:
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.policy = policy  # the engine's AdaptivePolicy; None: one with costs timed here on first use
        self.float_target = float_target
        self.max_tokens, self.context_window = max_tokens, context_window
        self.target_gguf = target_gguf
        self.eos_ids = _eos_ids(target, tokenizer)
        self._engine = None
        self._llamas: dict[bool, Any] = {}
        self._forwards = 0
        for model in (target, float_target):
            if model is not None:
                model.get_decoder().register_forward_hook(self._count_forward)

    def _count_forward(self, *_: Any) -> None:
        self._forwards += 1

    def missing(self, method: Method) -> str | None:
        """Why `method` cannot run here (a draft model, a GGUF file, a package), or None."""
        if method.kind == "llamacpp":
            if not llamacpp_installed():
                return "llama-cpp-python is not installed (docs/benchmarks.md says how)"
            return None if self.target_gguf is not None else "needs the target as a .gguf file"
        if method.float_weights and self.float_target is None:
            return "the target runs unquantized already (it is method 'target')"
        needs_draft = ("assistant_model" in method.hf_kwargs) if method.kind == "hf" else "ngram" not in method.fly.stages
        return "needs a draft model" if needs_draft and self.draft is None else None

    @property
    def engine(self):
        """The FLyEngine over the same models, built on first use, with the given policy or one whose
        costs are timed here (as `fly-daemon` does at start-up). Its n-gram stage keeps no recent answers:
        the methods run the same items one after another, and a copy of another method's answer to the
        same prompt would flatter the later one (and make an item's tokens depend on what ran before)."""
        if self._engine is None:
            from fly_llm.decoding.engine import FLyEngine
            from fly_llm.decoding.policy import AdaptivePolicy, Costs

            policy = self.policy or AdaptivePolicy(Costs.measure(self.target, self.draft))
            alone = FLyConfig(recent_answers=0)  # each item as if alone: no copies of earlier items' or methods' answers
            self._engine = FLyEngine(self.target, self.tokenizer, self.draft, alone,
                                     context_window=self.context_window, policy=policy)
        return self._engine

    def run(self, method: Method, prompt_ids: list[int], max_tokens: int | None = None,
            structure: Structure | None = None) -> Run:
        """Decode `prompt_ids` greedily with `method` (under `structure`'s grammar, if given); time it
        and count target forwards."""
        max_tokens = max_tokens or self.max_tokens
        self._forwards = 0
        if structure is not None and method.kind == "llamacpp":
            raise ValueError("structured runs compare torch methods only")
        with torch.inference_mode():
            if method.kind == "hf":
                run = self._run_hf(method, prompt_ids, max_tokens, structure)
            elif method.kind == "engine":
                run = self._run_engine(method, prompt_ids, max_tokens, structure)
            else:
                run = self._run_llamacpp(method, prompt_ids, max_tokens)
        if method.kind != "llamacpp":
            run.target_forwards = self._forwards
        run.token_ids = self.strip_eos(run.token_ids)
        return run

    def _run_hf(self, method: Method, prompt_ids: list[int], max_tokens: int, structure: Structure | None) -> Run:
        kwargs = dict(method.hf_kwargs)
        if "assistant_model" in kwargs:
            kwargs["assistant_model"] = self.draft
        if structure is not None:
            from fly_llm.decoding.grammar import GrammarLogitsProcessor

            matcher = self.engine.compile_constraint(Constraints.of(self.engine).constraint(structure))
            kwargs["logits_processor"] = [GrammarLogitsProcessor(matcher, len(prompt_ids), self.engine.vocab_size)]
        streamer = _FirstToken()
        model = self.float_target if method.float_weights else self.target
        input_ids = torch.tensor([prompt_ids], device=model.device)
        start = time.perf_counter()
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
            max_new_tokens=max_tokens, eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0],
            streamer=streamer, **kwargs)
        seconds = time.perf_counter() - start
        ttft = (streamer.at or time.perf_counter()) - start
        return Run(out[0, len(prompt_ids):].tolist(), seconds, ttft, 0)

    def _run_engine(self, method: Method, prompt_ids: list[int], max_tokens: int, structure: Structure | None) -> Run:
        engine = self.engine
        request_id = f"bench-{time.perf_counter_ns()}"
        tokens: list[int] = []
        ttft: float | None = None
        stats = RequestStats()
        start = time.perf_counter()
        engine.add_request(request_id, prompt_ids, SamplingParams(max_tokens=max_tokens), fly=method.fly,
                           constraint=Constraints.of(engine).constraint(structure))
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                if out.new_token_ids and ttft is None:
                    ttft = time.perf_counter() - start
                tokens.extend(out.new_token_ids)
                stats = out.stats
        seconds = time.perf_counter() - start
        return Run(tokens, seconds, ttft if ttft is not None else seconds, 0, stats.model_copy(deep=True))

    def policy_costs(self) -> dict[str, float] | None:
        """The engine policy's measured costs (None if no engine method ran)."""
        return dataclasses.asdict(self._engine.policy.costs) if self._engine is not None else None

    def llama(self, flash_attn: bool):
        """llama.cpp over the target's GGUF file, with or without flash attention, loaded on first use
        (torch's thread count)."""
        if flash_attn not in self._llamas:
            from llama_cpp import Llama

            threads = torch.get_num_threads()
            self._llamas[flash_attn] = Llama(str(self.target_gguf), n_ctx=min(self.context_window or 4096, 8192),
                                             n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn,
                                             verbose=False)
        return self._llamas[flash_attn]

    def _run_llamacpp(self, method: Method, prompt_ids: list[int], max_tokens: int) -> Run:
        """Greedy llama.cpp decoding of the same prompt ids (the GGUF holds the same vocabulary)."""
        llama = self.llama(method.flash_attn)
        llama.reset()  # no KV reuse between items: every method prefills the whole prompt
        tokens: list[int] = []
        ttft: float | None = None
        start = time.perf_counter()
        for token in llama.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            if token in self.eos_ids:
                break
            tokens.append(token)
            if len(tokens) >= max_tokens:
                break
        seconds = time.perf_counter() - start
        return Run(tokens, seconds, ttft if ttft is not None else seconds, max(1, len(tokens)))

    def strip_eos(self, ids: list[int]) -> list[int]:
        """`ids` without the end-of-sequence tokens at its end."""
        while ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return ids


def package_version(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """End-of-sequence ids: the model's generation config's, plus the tokenizer's."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = [configured] if isinstance(configured, int) else list(configured or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
