"""The transport-free core of the clients: request building, reply routing and the retry decisions.

Both `FLyClient` (threads) and `AsyncFLyClient` (asyncio) build their requests and decide what a
reply means here; they only move frames. Nothing here touches a socket, a thread or an event loop.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from fly_llm.common.config import REQUEST_OPTIONS, FLyOverrides, SamplingParams
from fly_llm.common.errors import BadRequest, Busy, FLyUnavailable, Timeout, error_from_code
from fly_llm.common.fim import Infill, InfillFile
from fly_llm.common.options import build_options, checked
from fly_llm.common.protocol import (
    ChatMessage, ErrorReply, GenerateRequest, GenerateResult, TokenChunk, TokenizeRequest, decode_reply,
)
from fly_llm.common.tools import STRUCTURE_OPTIONS, ToolSpec, option_names

POLL_S = 0.1
"""Longest single wait for a frame, so deadlines and liveness are checked often."""
RPC_ATTEMPT_S = 3.0
"""How long one attempt of info/health/status/tokenize waits before it is re-sent."""
BUSY_BACKOFF_S = 0.25
"""First wait before re-sending a generate request the daemon refused as BUSY (doubles each retry)."""
MAX_TIMEOUT_S = 86_400.0
"""The protocol's cap on a request deadline."""

Messages = list[ChatMessage | dict[str, Any]]
Prompt = str | Infill
"""A completion's input: text to continue, or an `Infill` (fly_llm.common.fim) to fill in the middle of."""
Tools = list[ToolSpec | dict[str, Any]]
"""OpenAI-style tools: {"type": "function", "function": {"name", "description", "parameters"}}."""


# ---- requests ----

def call_options(fields: object, call: dict[str, Any]) -> dict[str, Any]:
    """An adapter call's client keywords: `sampling`, `fly`, `timeout`, the structure options that are set and
    `suffix` where the call gives one (a completion's: fill in the middle; never a field).

    Each option is the call's value where the call gives one, else the adapter's field of that name
    (None, or no such field: the daemon's default); an unknown keyword is a TypeError.
    """
    def value(name: str) -> Any:
        return call[name] if name in call else getattr(fields, name, None)

    rest = {name: v for name, v in call.items() if name not in ("timeout", "suffix", *STRUCTURE_OPTIONS)}
    sampling, fly = build_options(**{**{name: getattr(fields, name) for name in REQUEST_OPTIONS}, **rest})
    structure = {name: value(name) for name in STRUCTURE_OPTIONS}
    suffix = {"suffix": call["suffix"]} if call.get("suffix") is not None else {}
    return {"sampling": sampling, "fly": fly, "timeout": value("timeout"), **suffix,
            **{name: v for name, v in structure.items() if v is not None}}


def new_id() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex


def _chat(messages: Messages | None) -> list[ChatMessage] | None:
    if messages is None:
        return None
    return [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]


def completion_source(prompt: Prompt | Messages, suffix: str | None) -> Prompt | Messages:
    """The prompt, or with a `suffix` the middle to fill in between them (OpenAI's `suffix`: the daemon builds
    the FIM prompt from the target's FIM tokens; FIM_UNSUPPORTED for a target without them)."""
    if suffix is None:
        return prompt
    if not isinstance(prompt, str):
        raise TypeError("suffix goes with a prompt string (not chat messages; an Infill carries its own suffix)")
    with checked():
        return Infill(prefix=prompt, suffix=suffix)


def make_infill(prefix: str, suffix: str, files: Iterable[InfillFile | dict[str, str]], filename: str,
                repo_name: str) -> Infill:
    """What to fill in (fly_llm.common.fim.Infill): the code before and after the cursor, other files of the
    repository (`{"filename", "text"}` each, put first in the model's repository format); BadRequest / TooLong."""
    with checked():
        return Infill(prefix=prefix, suffix=suffix, files=list(files), filename=filename, repo_name=repo_name)


def generate_request(prompt: Prompt | None, messages: Messages | None, sampling: SamplingParams | None,
                     fly: FLyOverrides | None, timeout: float, stream: bool = False,
                     **structure: Any) -> GenerateRequest:
    """A GenerateRequest for a prompt (completion: a string, or an Infill to fill in the middle of) or chat
    messages; BadRequest if it is not valid.

    `structure`: the structure options (`fly_llm.common.tools.StructureOptions`: tools, tool_choice, ...) as
    GenerateRequest takes them, None leaving one unset; another keyword is a TypeError.
    """
    option_names(structure)
    source = {"infill": prompt} if isinstance(prompt, Infill) else {"prompt": prompt}
    with checked():
        return GenerateRequest(id=new_id(), **source, messages=_chat(messages), sampling=sampling or SamplingParams(),
                               fly=fly or FLyOverrides(), stream=stream, timeout_s=min(timeout, MAX_TIMEOUT_S),
                               **structure)


def batch_requests(prompts: list[Prompt] | list[Messages], sampling: SamplingParams | None,
                   fly: FLyOverrides | None, timeout: float, suffix: str | None = None,
                   **structure: Any) -> list[GenerateRequest]:
    """One GenerateRequest per prompt: a string or an Infill (completion) or a list of chat messages; with a
    `suffix`, each is a string: the code before it (`completion_source`; else a TypeError)."""
    sources = [completion_source(p, suffix) for p in prompts]
    return [generate_request(None, s, sampling, fly, timeout, **structure) if isinstance(s, list)
            else generate_request(s, None, sampling, fly, timeout, **structure) for s in sources]


def tokenize_request(text: str | None, messages: Messages | None, tools: Tools | None = None) -> TokenizeRequest:
    """A TokenizeRequest for `text`, or for `messages` (and the `tools` offered) through the chat template."""
    with checked():
        return TokenizeRequest(id=new_id(), text=text, messages=_chat(messages), tools=tools)


# ---- replies ----

class Liveness(Protocol):
    def check(self, since: float, deadline: float, now: float) -> None: ...
    def heard(self) -> None: ...


class Inbox:
    """Replies that arrived, queued per open request id; frames for other ids are dropped.

    A request open when its connection dropped (`lose`: the daemon went away) is FLyUnavailable once the
    replies that came before are taken, whatever its deadline: it is never answered.
    """

    def __init__(self, liveness: Liveness) -> None:
        self._queues: dict[str, deque[BaseModel]] = {}
        self._lost: set[str] = set()
        self._liveness = liveness

    def open(self, ids: Iterable[str]) -> None:
        """Start collecting replies for `ids`."""
        for rid in ids:
            self._queues[rid] = deque()

    def close(self, ids: Iterable[str]) -> None:
        """Stop collecting replies for `ids` and forget what is queued for them."""
        for rid in ids:
            self._queues.pop(rid, None)
            self._lost.discard(rid)

    def lose(self) -> None:
        """The connection to the daemon dropped: no request open now gets another reply."""
        self._lost.update(self._queues)

    def __bool__(self) -> bool:
        return bool(self._queues)

    def deliver(self, frame: bytes) -> None:
        """Route one frame from the daemon to its request (a frame that cannot be read is dropped)."""
        try:
            reply = decode_reply(frame)
        except BadRequest:
            return
        self._liveness.heard()
        if reply.id in self._queues:
            self._queues[reply.id].append(reply)

    def take(self, rid: str, since: float, deadline: float) -> tuple[BaseModel | None, float]:
        """(the next reply for `rid`, None) if one is queued, else (None, seconds to wait for frames).

        Raises FLyUnavailable when the daemon went away or, asked at `since`, is silent, and Timeout at `deadline`.
        """
        queue = self._queues[rid]
        if queue:
            return queue.popleft(), 0.0
        if rid in self._lost:
            raise FLyUnavailable(f"the fly-daemon went away (its connection dropped) before request {rid} finished")
        now = time.monotonic()
        self._liveness.check(since, deadline, now)
        left = deadline - now
        if left <= 0:
            raise Timeout(f"request {rid} did not finish within its timeout")
        return None, min(POLL_S, left)


def answer(reply: BaseModel) -> Any:
    """A metadata reply, or the error the daemon answered with raised."""
    if isinstance(reply, ErrorReply):
        raise error_from_code(reply.code, reply.message)
    return reply


@dataclass
class Resend:
    """Send the request again after `delay` seconds: the daemon was BUSY and did not admit it."""

    delay: float


class GenerateReplies:
    """What each reply to one open generate request means, up to its result.

    `route` passes chunks and the result on, turns a BUSY refusal into a `Resend` while retries
    are left (the request was never admitted, so re-sending is safe) and raises any other error.
    `since` is when the daemon was last asked, for the liveness check.
    """

    def __init__(self, request: GenerateRequest, deadline: float, max_retries: int) -> None:
        self.request = request
        self.deadline = deadline
        self.since = time.monotonic()
        self.done = False
        self._max_retries = max_retries
        self._attempt = 0

    def route(self, reply: BaseModel) -> TokenChunk | GenerateResult | Resend | None:
        """What to do with `reply`: hand on a chunk or the result, re-send, or nothing (not ours)."""
        if isinstance(reply, ErrorReply) and reply.code == Busy.code and self._attempt < self._max_retries:
            delay = BUSY_BACKOFF_S * 2 ** self._attempt
            self._attempt += 1
            self.since = time.monotonic() + delay
            return Resend(delay)
        answer(reply)
        self.done = isinstance(reply, GenerateResult)
        return reply if isinstance(reply, (TokenChunk, GenerateResult)) else None


def rpc_windows(endpoint: str, timeout: float, max_retries: int) -> Iterator[float]:
    """How long each try of a metadata request waits; FLyUnavailable once every try went unanswered."""
    window = min(RPC_ATTEMPT_S, timeout)
    for _ in range(max_retries + 1):
        yield window
    raise FLyUnavailable(f"no fly-daemon answered at {endpoint} ({max_retries + 1} tries, {window:.1f} s each)")


def result_of(replies: Iterable[TokenChunk | GenerateResult]) -> GenerateResult:
    """The final GenerateResult of a request's replies."""
    *_, result = replies
    assert isinstance(result, GenerateResult)
    return result
