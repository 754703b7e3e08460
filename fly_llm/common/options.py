"""A request's options as the wire takes them, for everything that builds requests: the clients, the adapters
and the daemon's HTTP doors (each maps its API's names to REQUEST_OPTIONS, then calls `build_options`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from fly_llm.common.config import REQUEST_OPTIONS, FLyOverrides, SamplingParams
from fly_llm.common.protocol import invalid


def build_options(**options: Any) -> tuple[SamplingParams, FLyOverrides]:
    """Sampling parameters and FLy overrides from REQUEST_OPTIONS values; None keeps the daemon's default."""
    if unknown := set(options) - set(REQUEST_OPTIONS):
        raise TypeError(f"unknown option(s) {sorted(unknown)}; accepted: {', '.join(REQUEST_OPTIONS)}")
    given = {name: value for name, value in options.items() if value is not None}
    with checked():
        return (SamplingParams(**{n: v for n, v in given.items() if n in SamplingParams.model_fields}),
                FLyOverrides(**{n: v for n, v in given.items() if n in FLyOverrides.model_fields}))


@contextmanager
def checked() -> Iterator[None]:
    """Turn pydantic's ValidationError into BadRequest (TooLong for a size cap), as the daemon does."""
    try:
        yield
    except ValidationError as exc:
        raise invalid(exc) from None
