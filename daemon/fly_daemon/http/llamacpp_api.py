"""llama.cpp server's POST /infill and POST /completion on the HTTP front (fly_daemon.http.app): their bodies,
each translated into one `fly_llm.common.protocol.GenerateRequest` (/infill's fills in the middle:
fly_llm.common.fim), and their answers in the shape of llama.cpp's /completion (`content`, `stop`,
`tokens_predicted`, `timings`, ...), served through the front's door (`LlamaAnswer`).

Fields as llama.cpp names them: /infill's `input_prefix`, `input_suffix`, `input_extra` (other files, `[{filename,
text}]`; other fields of a file, such as llama.vim's `time`, are ignored), `prompt` (text after the prefix);
/completion's `prompt`; both take `n_predict` (-1: no limit; 0: the prompt is evaluated and cached, nothing
generated, as the editors' warm-up requests ask), `stream`, `temperature`, `top_p`, `seed`, `stop`, the
samplers (`top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`, `presence_penalty`, `frequency_penalty`:
docs/daemon.md, "Samplers"), FLy's options (`k`, `window`, `entropy_threshold`, `loose`) and `response_fields`
(the answer holds only these, nested ones as "timings/prompt_n" keys, as llama-server answers). A sampler FLy
does not have is accepted only at the value that turns it off (fly_daemon.http.shared_fields.SAMPLERS_OFF:
llama.cpp's names are Ollama's); llama.cpp's slot, cache and time settings and its sampler order (`samplers`)
are accepted and ignored (the prefix cache is always on); any other field is refused (400), so a typo never
passes silently.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fly_llm.common.options import build_options, checked
from fly_llm.common.fim import Infill
from fly_llm.common.errors import FLyError
from fly_llm.common.protocol import GenerateRequest, GenerateResult, TokenChunk

from fly_daemon.http.common import Answer, Event, data_event, openai_error
from fly_daemon.http.shared_fields import SAMPLER_SETTINGS, SAMPLERS_OFF, LlamaSamplers, check_sampler_off

IGNORED = frozenset({"cache_prompt", "id_slot", "n_keep", "min_keep", "penalize_nl", "t_max_predict_ms",
                     "t_max_prompt_ms", "samplers", *SAMPLER_SETTINGS})
"""llama.cpp fields accepted and ignored: slots and caching (ours is automatic), time caps, the sampler order
(FLy's is fixed), sampler settings that do nothing while their sampler is off."""


class ExtraFile(BaseModel):
    """One `input_extra` entry: a file's name and text (their size caps are the wire's, TOO_LONG); an editor's
    other fields of a file (llama.vim's `time`) are ignored."""

    model_config = ConfigDict(extra="ignore")

    filename: str = ""
    text: str


class LlamaBody(LlamaSamplers, ABC):
    """What llama.cpp's generating routes (/completion, /infill) share: the length, stream, seed, stop strings,
    samplers, FLy's options and `response_fields`; each route adds its source (`_source`)."""

    model_config = ConfigDict(extra="allow")
    route: ClassVar[str]

    model: str | None = Field(None, description="Accepted and not checked (llama.cpp serves one model).")
    n_predict: int | None = Field(None, ge=-1, description="Most tokens to generate; -1 or none: no limit; 0: "
                                  "evaluate (and cache) the prompt only.")
    stream: bool = False
    seed: int | None = Field(None, ge=-1, description="-1: a random seed (llama.cpp's).")
    stop: list[str] | None = None
    response_fields: list[str] | None = Field(None, max_length=64, description=(
        "Only these fields of the answer, nested ones by path ('timings/prompt_n') as their key."))
    k: int | None = None
    window: int | None = None
    entropy_threshold: float | None = None
    loose: bool | None = None

    @model_validator(mode="after")
    def _known(self) -> "LlamaBody":
        for name, value in (self.model_extra or {}).items():
            if name in SAMPLERS_OFF:
                check_sampler_off(name, value)
            elif name not in IGNORED:
                raise ValueError(f"{name}: not a field {self.route} serves")
        return self

    @property
    def warm_up(self) -> bool:
        """n_predict 0: the prompt is evaluated (and cached) and nothing is answered (one token is decoded, dropped)."""
        return self.n_predict == 0

    def to_generate(self, request_id: str, no_limit_tokens: int) -> GenerateRequest:
        """The wire request (n_predict -1 or none asks for `no_limit_tokens`); BadRequest / TooLong naming the field."""
        limit = no_limit_tokens if self.n_predict in (None, -1) else 1 if self.warm_up else self.n_predict
        sampling, fly = build_options(max_tokens=limit, temperature=self.temperature, top_p=self.top_p,
                                      top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repeat_penalty,
                                      repeat_last_n=self.repeat_last_n, presence_penalty=self.presence_penalty,
                                      frequency_penalty=self.frequency_penalty,
                                      seed=None if self.seed == -1 else self.seed, stop=self.stop, k=self.k,
                                      window=self.window, entropy_threshold=self.entropy_threshold, loose=self.loose)
        with checked():
            return GenerateRequest(id=request_id, sampling=sampling, fly=fly, stream=self.stream, **self._source())

    @abstractmethod
    def _source(self) -> dict[str, Any]:
        """The prompt, as GenerateRequest fields."""


class InfillBody(LlamaBody):
    """POST /infill: fill in between `input_prefix` (+ `prompt`) and `input_suffix`, `input_extra` as context."""

    route = "/infill"

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list, description="Other files of the repository.")
    prompt: str = Field("", description="Text after the prefix (llama.cpp's).")
    n_indent: int | None = Field(None, ge=0, description=(
        "Stop at the first line after the first indented less than this (the cursor line's indentation)."))

    def _source(self) -> dict[str, Any]:
        return {"infill": Infill(prefix=self.input_prefix, suffix=self.input_suffix, prompt=self.prompt,
                                 files=[f.model_dump(include={"filename", "text"}) for f in self.input_extra],
                                 min_indent=self.n_indent or 0)}


class CompletionBody(LlamaBody):
    """POST /completion: continue `prompt` (raw text: no chat template)."""

    route = "/completion"

    prompt: str

    def _source(self) -> dict[str, Any]:
        return {"prompt": self.prompt}


def completion_chunk(text: str) -> dict[str, Any]:
    """One event of a stream: new text, not the last."""
    return {"content": text, "stop": False}


def completion_answer(result: GenerateResult, model: str, text: str = "", predicted: bool = True) -> dict[str, Any]:
    """The whole answer (`text`: all of it), or the last event of a stream (no text), as llama.cpp's /completion:
    `stop_type` 'limit' at n_predict, else 'eos' (an EOS token or a stop string: the result does not tell which).
    Not `predicted` (a warm-up, n_predict 0): no tokens predicted."""
    first = result.time_to_first_token_s or 0.0
    prompt_n = result.usage.prompt_tokens - result.usage.cached_tokens
    predicted_n = result.usage.completion_tokens if predicted else 0
    prompt_ms, predicted_ms = first * 1e3, max(result.elapsed_s - first, 0.0) * 1e3 if predicted else 0.0
    return {"content": text, "stop": True, "model": model, "tokens_predicted": predicted_n,
            "tokens_evaluated": result.usage.prompt_tokens, "tokens_cached": result.usage.cached_tokens,
            "truncated": False, "stop_type": "limit" if result.finish_reason == "length" or not predicted else "eos",
            "timings": {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
                        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                        "prompt_per_second": prompt_n / (prompt_ms / 1e3) if prompt_ms else 0.0,
                        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
                        "predicted_per_second": predicted_n / (predicted_ms / 1e3) if predicted_ms else 0.0},
            "fly_stats": result.stats.model_dump()}


def only_fields(answer: dict[str, Any], paths: list[str] | None) -> dict[str, Any]:
    """`answer` with only the fields `paths` name (all: None), a nested one by its path ('timings/prompt_n') as its
    key, as llama-server's `response_fields`; a path naming nothing is left out."""
    if paths is None:
        return answer
    kept = {}
    for path in paths:
        value: Any = answer
        for part in path.split("/"):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is not _MISSING:
            kept[path] = value
    return kept


_MISSING = object()


class LlamaAnswer(Answer):
    """A /completion or /infill request's answer (the door contract): whole, or data events of new text and a last
    one with the counts (no `[DONE]`), each with only the `response_fields` asked for; a warm-up (n_predict 0)
    answers no text; an error after the stream began is an event in OpenAI's error shape, as llama-server's."""

    def __init__(self, body: LlamaBody, model: str, no_limit_tokens: int) -> None:
        """`body` asked of the served `model`; `no_limit_tokens`: what n_predict -1 asks for."""
        self.body, self.model, self.stream = body, model, body.stream
        self.request = body.to_generate(f"{body.route.strip('/')}-{uuid.uuid4().hex}", no_limit_tokens)

    def requests(self) -> list[GenerateRequest]:
        return [self.request]

    def whole(self, results: list[GenerateResult]) -> dict[str, Any]:
        result, predicted = results[0], not self.body.warm_up
        return only_fields(completion_answer(result, self.model, result.text if predicted else "", predicted),
                           self.body.response_fields)

    def chunk(self, index: int, chunk: TokenChunk) -> list[Event]:
        return [completion_chunk(chunk.text)] if chunk.text and not self.body.warm_up else []

    def final(self, index: int, result: GenerateResult, results: list[GenerateResult] | None) -> list[Event]:
        return [only_fields(completion_answer(result, self.model, predicted=not self.body.warm_up),
                            self.body.response_fields)]

    def failure(self, error: FLyError, status: int) -> list[Event]:
        return [openai_error(error, status)]

    def frame(self, event: Event) -> str:
        return data_event(event)
