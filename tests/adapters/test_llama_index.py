"""llama_index.llms.fly.FLyLLM against a real daemon serving the tiny random-weight pair.

Tiny models write gibberish, so these tests check behaviour: every LLM method (sync, async,
streaming) gives the same greedy text, stream deltas add up to it, usage reaches LlamaIndex's
TokenCountingHandler and instrumentation, stop strings and per-call options are honoured, and a
down daemon fails fast with FLyUnavailable.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from llama_index.core.base.llms.types import ChatMessage, CompletionResponse
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent

from fly_llm.client import FLyClient
from fly_llm.common.errors import FLyUnavailable
from llama_index.llms.fly import FLyLLM

PROMPT = "def add(a, b):"
MESSAGES = [ChatMessage(role="system", content="You answer briefly."),
            ChatMessage(role="user", content="The quick brown fox")]
MAX_TOKENS = 16
METHODS = ["complete", "acomplete", "stream_complete", "astream_complete",
           "chat", "achat", "stream_chat", "astream_chat"]


def call(llm: FLyLLM, method: str, **kwargs) -> tuple[str, list[str] | None, dict]:
    """Run one LLM method on PROMPT / MESSAGES: (final text, stream deltas or None, final raw)."""
    arg = MESSAGES if "chat" in method else PROMPT

    async def run_async():
        out = await getattr(llm, method)(arg, **kwargs)
        if "stream" not in method:
            return out
        return [r async for r in out]

    out = asyncio.run(run_async()) if method.startswith("a") else getattr(llm, method)(arg, **kwargs)
    if "stream" not in method:
        return _text(out), None, out.raw
    out = list(out)
    for before, after in zip(out, out[1:]):
        assert _text(after) == _text(before) + after.delta  # running text grows by each delta
    return _text(out[-1]), [r.delta for r in out], out[-1].raw


def _text(response) -> str:
    return response.text if isinstance(response, CompletionResponse) else response.message.content


@pytest.fixture(scope="module")
def llm(tiny_daemon) -> FLyLLM:
    return FLyLLM(endpoint=tiny_daemon, max_tokens=MAX_TOKENS, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_daemon) -> dict[str, str]:
    """The greedy texts straight from the client, for prompts and for chat."""
    with FLyClient(tiny_daemon) as client:
        llm = FLyLLM(endpoint=tiny_daemon, max_tokens=MAX_TOKENS)
        options = llm._request({})
        return {"complete": client.generate(PROMPT, **options).text,
                "chat": client.chat([{"role": m.role.value, "content": m.content} for m in MESSAGES],
                                    **options).text}


def test_import_needs_no_torch():
    code = "import sys; from llama_index.llms.fly import FLyLLM; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_metadata_comes_from_info_once(llm, tiny_daemon, monkeypatch):
    info = FLyClient(tiny_daemon).info()
    meta = llm.metadata
    assert (meta.context_window, meta.num_output) == (info.context_window, MAX_TOKENS)
    assert meta.model_name == info.target
    assert meta.is_chat_model
    monkeypatch.setattr(llm.client, "info", lambda: pytest.fail("metadata asked the daemon again"))
    assert llm.metadata == meta
    assert FLyLLM(endpoint=tiny_daemon).metadata.num_output == info.sampling_defaults.max_tokens


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_the_greedy_text(llm, reference, method):
    text, deltas, raw = call(llm, method)
    assert text == reference["chat" if "chat" in method else "complete"]
    if deltas is not None:
        assert "".join(deltas) == text
        assert len(deltas) >= 2  # at least one chunk, then the result carrying usage
    usage = raw["usage"]
    assert 1 <= usage["completion_tokens"] <= MAX_TOKENS
    assert usage["completion_tokens"] == len(raw["token_ids"])
    assert usage["prompt_tokens"] > 0


async def test_concurrent_async_calls_share_the_daemon(llm, reference):
    """Really async: several calls in flight at once on one event loop, each with its own answer."""
    texts = await asyncio.gather(*(llm.acomplete(PROMPT) for _ in range(3)), llm.achat(MESSAGES))
    assert [_text(t) for t in texts] == [reference["complete"]] * 3 + [reference["chat"]]


@pytest.mark.parametrize("method", METHODS)
def test_token_counting_handler_counts_daemon_usage(tiny_daemon, method):
    counter = TokenCountingHandler()
    llm = FLyLLM(endpoint=tiny_daemon, max_tokens=MAX_TOKENS, callback_manager=CallbackManager([counter]))
    _, _, raw = call(llm, method)
    assert len(counter.llm_token_counts) == 1
    # The daemon's tokenizer, not LlamaIndex's tiktoken estimate: the tiny tokenizer differs a lot.
    assert counter.prompt_llm_token_count == raw["usage"]["prompt_tokens"]
    assert counter.completion_llm_token_count == raw["usage"]["completion_tokens"]


class _Collect(BaseEventHandler):
    events: list = []

    @classmethod
    def class_name(cls) -> str:
        return "Collect"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
            self.events.append(event)


@pytest.fixture
def llm_events():
    """LLM end events seen by the root instrumentation dispatcher during the test."""
    handler = _Collect(events=[])
    root = get_dispatcher()
    root.add_event_handler(handler)
    yield handler.events
    root.event_handlers.remove(handler)


@pytest.mark.parametrize("method", ["complete", "astream_complete", "chat", "astream_chat"])
def test_instrumentation_events_fire(llm, llm_events, method):
    text, _, _ = call(llm, method)
    assert len(llm_events) == 1
    event = llm_events[0]
    assert _text(event.response) == text
    assert isinstance(event, LLMChatEndEvent if "chat" in method else LLMCompletionEndEvent)


@pytest.mark.parametrize("method", ["complete", "stream_complete", "achat", "astream_chat"])
def test_stop_string_cuts_the_text(tiny_daemon, reference, method):
    full = reference["chat" if "chat" in method else "complete"]
    assert len(full) >= 4, "the tiny model should write a few characters"
    stop = full[2:4]
    cut = full[:full.index(stop)]
    as_field = FLyLLM(endpoint=tiny_daemon, max_tokens=MAX_TOKENS, stop=[stop])
    assert call(as_field, method)[0] == cut
    per_call = FLyLLM(endpoint=tiny_daemon, max_tokens=MAX_TOKENS)
    assert call(per_call, method, stop=[stop])[0] == cut


@pytest.mark.parametrize("method", ["complete", "astream_chat"])
def test_a_call_stop_replaces_the_field(tiny_daemon, reference, method):
    full = reference["chat" if "chat" in method else "complete"]
    stop = full[2:4]
    later = next(full[i:i + 2] for i in range(full.index(stop) + 2, len(full) - 1)
                 if full.index(full[i:i + 2]) > full.index(stop))
    as_field = FLyLLM(endpoint=tiny_daemon, max_tokens=MAX_TOKENS, stop=[stop])
    assert call(as_field, method, stop=[later])[0] == full[:full.index(later)]  # the field's stop is not kept
    assert call(as_field, method, stop=[])[0] == full


def test_call_options_override_fields(llm):
    _, _, raw = call(llm, "complete", max_tokens=3)
    assert raw["usage"]["completion_tokens"] <= 3
    assert raw["finish_reason"] == "length" or raw["usage"]["completion_tokens"] < 3


def test_unknown_option_is_an_error(llm):
    with pytest.raises(TypeError, match="max_token"):
        llm.complete(PROMPT, max_token=3)


def test_exact_mode_equals_loose_off_request(tiny_daemon):
    """loose=False reaches the daemon: the exact-mode text is the client's own exact-mode text."""
    exact = FLyLLM(endpoint=tiny_daemon, max_tokens=MAX_TOKENS, loose=False, k=4)
    with FLyClient(tiny_daemon) as client:
        expected = client.generate(PROMPT, **exact._request({})).text
    assert call(exact, "complete")[0] == expected


@pytest.fixture
def down_llm(tmp_path) -> FLyLLM:
    """An LLM pointed at a socket nobody serves."""
    return FLyLLM(endpoint=f"ipc://{tmp_path}/nobody.sock", timeout=1.0, max_retries=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_down_daemon_raises_unavailable(down_llm, method):
    with pytest.raises(FLyUnavailable):
        call(down_llm, method)


@pytest.mark.timeout(60)
def test_down_daemon_metadata_raises_unavailable(down_llm):
    with pytest.raises(FLyUnavailable):
        down_llm.metadata


def test_a_repeated_chat_reports_cached_prompt_tokens_in_raw_usage(llm):
    """The tiny daemon runs with the default prefix cache: the second identical chat reuses the first's prompt."""
    first, again = (llm.chat(MESSAGES).raw["usage"] for _ in range(2))
    assert 0 < again["cached_tokens"] < again["prompt_tokens"] == first["prompt_tokens"]
