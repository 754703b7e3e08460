"""A row's fault is the row's (docs/design.md §3.3): the per-row stages of one engine round.

Sampling, grammar, log-probabilities and detokenizing work row by row. An exception in one row's
stage (our bug, a numeric edge, a panic of the native grammar engine) must end that request alone
with a stable code and one line of our own, while every other row of the batch goes on. `RowFaults`
collects them for one round: `guard(row, stage)` runs a row's work and records what it raised
(the traceback goes to the log, never to a client).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from fly_llm.common.errors import BadRequest, FLyError, Internal, contained

log = logging.getLogger("fly_llm.engine")

STAGES: dict[str, type[FLyError]] = {
    "sampling": Internal,
    "log-probabilities": Internal,
    "detokenizing": Internal,
    "grammar": BadRequest,  # the request's own grammar made the grammar engine fail
}
"""Each per-row stage and the error its fault ends the request with."""


class RowFaults:
    """The rows of one round whose per-row stage raised, with the error each one ends with."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids  # per row, for the log
        self.errors: dict[int, FLyError] = {}

    def __contains__(self, row: int) -> bool:
        return row in self.errors

    def add(self, row: int, stage: str, exc: BaseException) -> None:
        """Record that `row`'s `stage` raised `exc` (its first fault wins); the traceback goes to the log."""
        log.error("request %s failed in %s; it ends alone", self.request_ids[row], stage, exc_info=exc)
        self.errors.setdefault(row, STAGES[stage](f"the request failed in the engine's {stage} stage "
                                                  f"(an internal error; the daemon's log has the details)"))

    @contextmanager
    def guard(self, row: int, stage: str) -> Iterator[None]:
        """Run one row's work of `stage`; a contained exception is recorded, not raised."""
        try:
            yield
        except BaseException as exc:
            if not contained(exc):
                raise
            self.add(row, stage, exc)
