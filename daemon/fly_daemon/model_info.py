"""What the fronts know of the served model (`ModelInfo`): read once from the engine when it loads.

The scheduler exposes it (`Scheduler.model`); the fronts (the ZeroMQ server's info reply, the HTTP
doors through fly_daemon.inproc) describe the model with it and never reach into the engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from fly_llm.common.config import FLyConfig
from fly_llm.common.fim import FimTokens

if TYPE_CHECKING:
    from fly_llm.decoding.engine import FLyEngine


@dataclass(frozen=True)
class ModelInfo:
    """The served target (and draft): names, context window, chat template and sizes."""

    name: str
    draft: str | None
    context_window: int
    chat_template: str
    """Its tokenizer's chat template ("" without one; several named templates as JSON)."""
    architecture: str
    """The target's config's model_type (Ollama's model family)."""
    parameter_count: int
    """The target's weights: its parameters' values, and each packed 4-bit layer's in x out."""
    size_bytes: int
    """The target's parameters and buffers in bytes."""
    quantization: str
    draft_quantization: str
    device: str
    dtype: str
    fly_defaults: FLyConfig
    fim: FimTokens | None = None
    """Its tokenizer's fill-in-the-middle tokens (fly_llm.common.fim); None: it cannot fill in the middle."""

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def of(cls, engine: "FLyEngine") -> "ModelInfo":
        """The facts of a loaded engine's models."""
        template = getattr(engine.tokenizer, "chat_template", None) or ""
        target = getattr(engine, "target", None)  # a test double of the engine has no model
        draft = engine.draft_name
        return cls(name=served_id(engine.target_name), draft=None if draft is None else served_id(draft),
                   context_window=engine.context_window,
                   chat_template=template if isinstance(template, str) else json.dumps(template),
                   architecture=_architecture(target), parameter_count=_weights(target),
                   size_bytes=_count(target, "parameters", "buffers", in_bytes=True),
                   quantization=engine.target_quantization, draft_quantization=engine.draft_quantization,
                   device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
                   fly_defaults=engine.config, fim=getattr(engine, "fim", None))


_CACHE_KEY = re.compile(r"-[0-9a-f]{12}$")
"""The key the model cache (fly_llm.model.cache) appends to a converted GGUF's directory name."""


def served_id(name_or_path: str) -> str:
    """The id a model is served under, never a path: a path's last part, without `.gguf` and without the model
    cache's key (`~/.cache/fly-llm/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M-cc324af070c2` is
    `Qwen2.5-Coder-1.5B-Instruct-Q4_K_M`)."""
    base = PurePath(name_or_path).name or name_or_path
    stem = base[:-len(".gguf")] if base.lower().endswith(".gguf") else base
    return _CACHE_KEY.sub("", stem) or base


def _weights(target: Any) -> int:
    """The target's weights: its parameters' values, plus in x out for each layer of packed 4-bit weights (stored
    as buffers: counted as parameters they made a 1.5B model 233M)."""
    if target is None:
        return 0
    packed = sum(m.in_features * m.out_features for m in target.modules() if getattr(m, "packed", None) is not None)
    return _count(target, "parameters") + packed


def _architecture(target: Any) -> str:
    if target is None:
        return ""
    return str(getattr(target.config, "model_type", "") or type(target).__name__)


def _count(target: Any, *kinds: str, in_bytes: bool = False) -> int:
    """Values (or bytes, `in_bytes`) in the target's tensors of `kinds` ('parameters', 'buffers')."""
    if target is None:
        return 0
    tensors = [t for kind in kinds for t in getattr(target, kind)()]
    return sum(t.numel() * (t.element_size() if in_bytes else 1) for t in tensors)
