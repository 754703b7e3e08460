"""Load the target and draft models a ModelSpec names (docs/design.md §5).

A source is a Hugging Face model id (resolved through the normal HF cache, so it works offline
once cached), a local model directory, or a `.gguf` file (converted once to the safetensors
cache, fly_llm.model.cache). No target means the embedded default pair (fly_llm.model.embedded).
Under w4a8 a GGUF's Linear weights of the block types the kernel reads (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q4_0,
Q4_1, Q5_1) are taken as published (fly_llm.model.kernels.gguf_blocks), the others (Q2_K, Q3_K, the IQ types)
rounded to 4 bits from their float weights, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fly_llm.model.attention import use_float32_attention
from fly_llm.common.config import ModelSpec
from fly_llm.model.embedded import DRAFT, TARGET, ensure_default_pair
from fly_llm.common.errors import ModelError
from fly_llm.model.kernels.cpu import cpu_flags
from fly_llm.model.cache import cached_conversion, hf_progress, published_weights
from fly_llm.model.cache_paths import cache_root
from fly_llm.model.draft_vocabulary import kept_count, restrict_draft_vocabulary
from fly_llm.model.quantization import quantize

log = logging.getLogger(__name__)

MAX_CONTEXT = 32_768  # cap on the context window: KV memory grows with it, and few configs need more here
NO_DRAFT = "none"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class LoadedModels:
    """A target, an optional draft sharing its vocabulary, and the target's tokenizer."""

    target: PreTrainedModel
    draft: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase
    target_name: str
    draft_name: str | None
    device: torch.device
    dtype: torch.dtype
    context_window: int
    target_quantization: str = "none"
    draft_quantization: str = "none"
    draft_vocabulary: int = 0  # tokens the draft's head scores (fly_llm.model.draft_vocabulary); 0: all
    draft_weights: str = "published"  # how its weights are stored (ModelSpec.draft_weights)


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bfloat16 natively (AVX-512 BF16 or AMX), where bf16 beats fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_device(device: str) -> torch.device:
    """'auto' → CUDA if available, else CPU; anything else is passed to torch.device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ModelError(f"unknown device {device!r}: {exc}") from exc


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' → bf16 on CUDA (fp16 without bf16 support); on CPU bf16 where native, else fp32."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else torch.float32


def resolve_source(source: str, progress: bool = True) -> str:
    """A path or id `from_pretrained` can load; a `.gguf` file becomes its safetensors cache dir."""
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        path = path.resolve()
        stat = path.stat()
        # Keyed by path, size and mtime: re-keys when the file changes, without hashing gigabytes.
        key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return str(cached_conversion(cache_root(), f"{path.stem}-{key}", lambda _: path, progress=progress,
                                     source={"gguf": str(path), "size": stat.st_size}))
    if path.is_dir():
        return str(path)
    if source.startswith((".", "/", "~")) or path.exists():
        raise ModelError(f"model path {source!r} is not a model directory or a .gguf file")
    return source  # a Hugging Face model id


def _load_tokenizer(source: str, name: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ModelError(f"could not load the tokenizer of {name}: {exc}") from exc


def _load_model(source: str, name: str, dtype: torch.dtype, device: torch.device,
                device_map: str | None) -> PreTrainedModel:
    """Load straight onto `device` (or spread by accelerate's `device_map`), in eval mode; a half-precision
    model on CPU attends in float32 (`fly_llm.model.attention`).

    `use_kernels=False`: transformers 5 otherwise swaps layers for kernels it downloads from the Hub
    when the `kernels` package is installed (on CUDA: `kernels-community/rotary`), which is network
    at run time and fails offline."""
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=device_map or {"": device},
                                                     use_kernels=False)
    except (OSError, ValueError) as exc:
        raise ModelError(f"could not load the model {name}: {exc}") from exc
    use_float32_attention(model)
    return model.eval()


def check_shared_vocab(tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase,
                       draft: PreTrainedModel, target_name: str, draft_name: str) -> None:
    """ModelError unless the draft's token→id mapping equals the target's and its embedding covers it.

    The mappings are compared, not the models' vocab_size: embedding matrices are often padded
    past the tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens).
    """
    target_vocab, draft_vocab = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differ = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])[:3]
        raise ModelError(
            f"the draft {draft_name} does not share the target {target_name}'s vocabulary "
            f"({len(draft_vocab):,} vs {len(target_vocab):,} tokens; differing entries e.g. {differ}). "
            f"Use a draft from the target's model family, or --draft none for n-gram drafting only."
        )
    rows = draft.get_input_embeddings().num_embeddings
    if rows < len(tokenizer):
        raise ModelError(f"the draft {draft_name} embeds {rows:,} tokens, fewer than the tokenizer's "
                         f"{len(tokenizer):,}")


def context_window(model: PreTrainedModel) -> int:
    """The target config's max_position_embeddings, capped at MAX_CONTEXT (2,048 if unset)."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2048
    return min(int(limit), MAX_CONTEXT)


def load_models(spec: ModelSpec, progress: bool = True) -> LoadedModels:
    """Load the target (and draft) named by `spec`; ModelError with a clear message on failure.

    target None → the embedded default pair (draft None → its draft). With an own target,
    draft None or 'none' → no draft model (n-gram drafting only).
    """
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    if spec.target is None:
        target_dir, default_draft_dir = ensure_default_pair(progress=progress)
        target_path, target_name = str(target_dir), TARGET.name
        default_draft = (str(default_draft_dir), DRAFT.name)
    else:
        target_path, target_name = resolve_source(spec.target, progress), spec.target
        default_draft = None
    if spec.draft is None:
        draft_ref = default_draft
    elif spec.draft.lower() == NO_DRAFT:
        draft_ref = None
    else:
        draft_ref = (resolve_source(spec.draft, progress), spec.draft)
    with hf_progress(progress):
        tokenizer = _load_tokenizer(target_path, target_name)
        target = _load_model(target_path, target_name, dtype, device, spec.device_map)
        device = target.get_input_embeddings().weight.device  # the first device under a device_map
        target_scheme = quantize(target, spec.target_quantization, device, "target", published_weights(target_path))
        draft = draft_name = None
        draft_scheme = "none"
        if draft_ref is not None:
            draft_path, draft_name = draft_ref
            draft_tokenizer = _load_tokenizer(draft_path, draft_name)
            draft = _load_model(draft_path, draft_name, dtype, device, None)
            check_shared_vocab(tokenizer, draft_tokenizer, draft, target_name, draft_name)
            published = published_weights(draft_path) if spec.draft_weights == "published" else None
            draft_published = restrict_draft_vocabulary(draft, tokenizer, spec.draft_vocabulary, published)
            draft_scheme = quantize(draft, spec.draft_quantization, device, "draft", draft_published)
    log.info("loaded target %s (%s weights), draft %s (%s weights); %s on %s", target_name, target_scheme,
             draft_name or "none", draft_scheme, dtype, device)
    return LoadedModels(target=target, draft=draft, tokenizer=tokenizer, target_name=target_name,
                        draft_name=draft_name, device=device, dtype=dtype, context_window=context_window(target),
                        target_quantization=target_scheme, draft_quantization=draft_scheme,
                        draft_vocabulary=kept_count(draft), draft_weights=spec.draft_weights)
