"""The body fields several HTTP APIs share, declared once so that no API's module imports another's.

`Strict`: the base of every body that refuses unknown fields (a typo, or a feature we do not have, is
answered 400 with the field named, never ignored) and values of the wrong JSON type (no coercion). `FLyFields`: FLy's own options, extra body fields on every
generating route. `LlamaSamplers`: the samplers llama.cpp's requests and Ollama's `options` name alike, with
the samplers FLy does not have (`SAMPLERS_OFF`, accepted only at the value that turns them off) and the
settings that do nothing while those are off (`SAMPLER_SETTINGS`, accepted and ignored).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SAMPLERS_OFF = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
"""Samplers FLy does not have (Ollama's and llama.cpp's names), each with the value that turns it off (the only
one accepted)."""
SAMPLER_SETTINGS = frozenset({"mirostat_tau", "mirostat_eta", "penalize_newline"})
"""Settings accepted and ignored: mirostat's do nothing while it is off; penalize_newline is gone from Ollama's
own engine, which (like FLy) penalizes a newline as any other token."""


def check_sampler_off(name: str, value: Any) -> None:
    """ValueError unless `value` of the sampler `name` (one of SAMPLERS_OFF) is unset or its off value, a number
    (Ollama's `typical_p: true` is not 1.0)."""
    off = SAMPLERS_OFF[name]
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value != off):
        raise ValueError(f"{name} {value!r}: FLy has no such sampler (leave it out, or set it to {off!r}: off)")


class Strict(BaseModel):
    """A body (or part of one) that refuses fields it does not declare, and values of another JSON type than the
    field's (`"max_tokens": true` or `"8"` is a 400, not 1 or 8; an integer is a number where a float is asked)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class FLyFields(Strict):
    """FLy's own options, extra body fields on every generating route (OpenAI's, the Responses and Messages APIs)."""

    k: int | None = Field(None, description="FLy: upper bound on draft tokens per round.")
    window: int | None = Field(None, description="FLy: deferred window W.")
    entropy_threshold: float | None = Field(None, description="FLy: entropy gate θ in nats.")
    loose: bool | None = Field(None, description="FLy: loose acceptance (false = exact, lossless SPD).")

    def fly_options(self) -> dict[str, Any]:
        """These fields as `fly_llm.common.options.build_options` keywords."""
        return {"k": self.k, "window": self.window, "entropy_threshold": self.entropy_threshold, "loose": self.loose}


class LlamaSamplers(BaseModel):
    """The samplers llama.cpp's requests and Ollama's `options` name alike (mapped to FLy's by the routes)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = Field(None, description="FLy's repetition_penalty.")
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
