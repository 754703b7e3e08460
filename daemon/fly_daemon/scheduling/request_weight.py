"""What one generate request weighs: its share of a client's admission budget and the size of its reply.

A request's *weight* is the tokens it makes the daemon produce or score for its client: `max_tokens`, plus its
prompt's tokens when their log-probabilities are echoed back (known once it is tokenized). The choices of one
OpenAI request (`n`) are `n` requests, so they weigh `n × max_tokens` together against the client's
`max_tokens_per_client` (the scheduler sums the weights of a client's queued and running requests).

A request's *reply units* are the token entries its reply carries, each with its alternatives:
`choices × (echoed prompt tokens + max_tokens) × (1 + top logprobs)`; more than `max_reply_units` is
refused (TOO_LONG) once the prompt is tokenized, before any work.
"""

from __future__ import annotations

from fly_llm.common.errors import Busy, TooLong
from fly_llm.common.protocol import GenerateRequest


def echoed_tokens(request: GenerateRequest, prompt_tokens: int) -> int:
    """The prompt tokens whose log-probabilities go back to the client (0 unless it asked for them)."""
    return prompt_tokens if request.prompt_logprobs else 0


def weight(request: GenerateRequest, prompt_tokens: int = 0) -> int:
    """Tokens the request makes the daemon produce or score: max_tokens and the echoed prompt tokens
    (`prompt_tokens` is 0 until the prompt is tokenized)."""
    return request.sampling.max_tokens + echoed_tokens(request, prompt_tokens)


def reply_units(request: GenerateRequest, prompt_tokens: int) -> int:
    """Token entries (each with its alternatives) the replies of all of the request's choices may carry."""
    alternatives = request.logprobs or 0
    return request.choices * weight(request, prompt_tokens) * (1 + alternatives)


def check_admission(request: GenerateRequest, held: int, cap: int) -> None:
    """Admit a request whose client holds requests weighing `held`, under the per-client `cap`: TooLong if the
    request alone weighs more than the cap, Busy if it does not fit beside what the client holds."""
    need = weight(request)
    if need > cap:
        raise TooLong(f"max_tokens {need} exceeds the daemon's max_tokens_per_client {cap}")
    if held + need > cap:
        raise Busy(f"this client's queued and running requests already weigh {held} tokens; {need} more exceed "
                   f"the daemon's max_tokens_per_client {cap}")


def check_reply_size(request: GenerateRequest, prompt_tokens: int, limit: int) -> None:
    """TooLong if the request's replies may carry more than `limit` reply units, naming the factors."""
    units = reply_units(request, prompt_tokens)
    if units > limit:
        raise TooLong(f"the reply would carry {units} token entries (choices {request.choices} × (echoed prompt "
                      f"tokens {echoed_tokens(request, prompt_tokens)} + max_tokens {request.sampling.max_tokens}) × "
                      f"(1 + top logprobs {request.logprobs or 0})), more than the daemon's max_reply_units {limit}")
