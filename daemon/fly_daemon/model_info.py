"""What the fronts know of the served model (`ModelInfo`): read once from the engine when it loads.

The scheduler exposes it (`Scheduler.model`); the fronts (the ZeroMQ server's info reply, the HTTP
doors through fly_daemon.inproc) describe the model with it and never reach into the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    """Values in the target's parameters (packed quantized weights count as stored)."""
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
        return cls(name=engine.target_name, draft=engine.draft_name, context_window=engine.context_window,
                   chat_template=template if isinstance(template, str) else json.dumps(template),
                   architecture=_architecture(target), parameter_count=_count(target, "parameters"),
                   size_bytes=_count(target, "parameters", "buffers", in_bytes=True),
                   quantization=engine.target_quantization, draft_quantization=engine.draft_quantization,
                   device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
                   fly_defaults=engine.config, fim=getattr(engine, "fim", None))


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
