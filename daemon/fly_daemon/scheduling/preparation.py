"""Preparation, the scheduler's second room: a request's prompt and constraint made ready for the engine.

Runs in the scheduler's preparation pool, off the model thread, in two parts. `prepare`: the character
limit (before anything is read), the chat template and tokenizer, the token limit, the constraint of the
request's structure (the model's tool format, `fly_llm.common.tool_formats`) and, when its scope has
compiled that grammar already, its matcher; bounded work (the limits). `compile`: a grammar new to its
scope, compiled (in the sandbox first: up to its time limit), the part the queue lets each client do
once at a time (fly_daemon.scheduling.request_queue). Tokenize requests are answered here too (the same limits and
template, in the scheduler's tokenize lane). The queue and the loop: fly_daemon.scheduling.scheduler; what comes
out of the engine: fly_daemon.scheduling.delivery.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fly_llm.common.constraints import Constraint
from fly_llm.common.errors import BadRequest, FLyError, TooLong
from fly_llm.common.protocol import GenerateRequest, TokenizeReply, TokenizeRequest
from fly_llm.common.tool_formats import Constraints

from fly_daemon.limits import Limits
from fly_daemon.scheduling.request_weight import check_reply_size

if TYPE_CHECKING:
    from fly_llm.decoding.engine import FLyEngine

log = logging.getLogger("fly_daemon")

CHARS_PER_TOKEN = 16
"""Characters a prompt may have per token of the token limit when `max_prompt_chars` is unset: far more
than any tokenizer averages over real text, so only prompts that cannot fit are refused unread."""


@dataclass(frozen=True, eq=False)
class PreparedInput:
    """What a generate request gives the engine: its prompt's token ids, its constraint (None: free
    output) and that constraint's compiled grammar, unless it `needs_compile` still (`Preparation.compile`)."""

    prompt_ids: list[int]
    constraint: Constraint | None
    matcher: object | None
    needs_compile: bool = False


class Preparation:
    """Prepares requests for a loaded `engine` under `limits`; thread-safe (the pool's threads share it).

    `constraints`: the model's structures to constraints (its tool format chosen by its chat template).
    """

    def __init__(self, engine: "FLyEngine", limits: Limits, constraints: Constraints) -> None:
        self._engine = engine
        self._limits = limits
        self._constraints = constraints

    def prepare(self, request: GenerateRequest, scope: str) -> PreparedInput:
        """Tokenize the prompt (within the limits) and find its constraint's grammar in cache `scope`
        (else it `needs_compile`); BadRequest or TooLong for a prompt that cannot be served."""
        prompt_ids = self._tokens_of(request)
        if not prompt_ids:
            raise BadRequest("the prompt encodes to no tokens")
        cap = self.token_cap()
        if len(prompt_ids) > cap:
            raise TooLong(f"prompt of {len(prompt_ids)} tokens exceeds the limit of {cap}")
        check_reply_size(request, len(prompt_ids), self._limits.max_reply_units)
        constraint = self._constraints.constraint(request.structure)
        if constraint is None:
            return PreparedInput(prompt_ids, None, None)
        matcher = self._engine.compiled_matcher(constraint, scope)
        return PreparedInput(prompt_ids, constraint, matcher, needs_compile=matcher is None)

    def compile(self, prepared: PreparedInput, scope: str) -> PreparedInput:
        """`prepared` with its constraint's grammar compiled in cache `scope` (BadRequest for a bad one)."""
        return replace(prepared, matcher=self._engine.compile_constraint(prepared.constraint, scope),
                       needs_compile=False)

    def tokenize(self, request: TokenizeRequest) -> TokenizeReply:
        """The answer to a tokenize request: its text's token ids, or its token ids' text."""
        if request.token_ids is not None:
            ids, cap = request.token_ids, self.token_cap()
            if len(ids) > cap:
                raise TooLong(f"{len(ids)} token ids exceed the limit of {cap}")
            return TokenizeReply(id=request.id, token_ids=ids, count=len(ids), text=self._engine.decode(ids))
        ids = self._tokens_of(request)
        return TokenizeReply(id=request.id, token_ids=ids, count=len(ids))

    def token_cap(self) -> int:
        """The most tokens a prompt may have."""
        return self._limits.max_prompt_tokens or self._engine.context_window - 1

    def _tokens_of(self, request: GenerateRequest | TokenizeRequest) -> list[int]:
        """The prompt's token ids (chat template applied), once it is within the character limit."""
        chars = _prompt_chars(request)
        cap = self._limits.max_prompt_chars or CHARS_PER_TOKEN * self.token_cap()
        if chars > cap:
            raise TooLong(f"prompt of {chars} characters exceeds the limit of {cap}")
        text = request.prompt if isinstance(request, GenerateRequest) else request.text
        special = isinstance(request, GenerateRequest) or request.add_special
        infill = request.infill if isinstance(request, GenerateRequest) else None
        try:
            return self._engine.encode(text, *_template_inputs(request), add_special=special, infill=infill)
        except FLyError:
            raise
        except Exception as exc:  # noqa: BLE001 - a tokenizer's failure: named by its kind, its text only logged
            log.info("encoding a request's prompt failed", exc_info=exc)
            raise BadRequest(f"cannot encode the prompt ({type(exc).__name__})") from None


def _prompt_chars(request: GenerateRequest | TokenizeRequest) -> int:
    """Characters of a request's prompt: its text, its fill-in-the-middle parts, or its messages and tools as JSON."""
    text = request.prompt if isinstance(request, GenerateRequest) else request.text
    if text is not None:
        return len(text)
    if isinstance(request, GenerateRequest) and request.infill is not None:
        return request.infill.chars
    return len(json.dumps(_template_inputs(request), ensure_ascii=False))


def _template_inputs(request: GenerateRequest | TokenizeRequest) -> tuple[list[dict] | None, list[dict] | None]:
    """A request's chat messages and tools as the chat template takes them (generate and tokenize alike)."""
    messages = [m.for_template() for m in request.messages] if request.messages is not None else None
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    return messages, tools
