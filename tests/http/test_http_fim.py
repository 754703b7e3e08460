"""Fill-in-the-middle on every door, in-process on a tiny pair whose tokenizer has Qwen2.5-Coder's FIM tokens
(exact mode, prefix cache on), and refusals on one whose tokenizer has none.

The HTTP front: `suffix` on /v1/completions and /api/generate, llama.cpp's /infill (whole and streamed),
/api/show's template with `.Suffix` and the `insert` capability. The ZeroMQ side: FLyClient's and
AsyncFLyClient's `infill`, `generate(suffix=)`, `stream` and `batch`, the same as /infill's answer for the same
request, and LangChain's and LlamaIndex's FLyLLM with a `suffix` call option. Each answer is the target's own
greedy middle for the FIM prompt written out by hand; consecutive keystrokes reuse the prefix cache; bad input
gets a clear 4xx, a target without FIM tokens FIM_UNSUPPORTED (FimUnsupported in Python) on every door.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import ollama
import openai
import pytest
import torch

from fly_llm.client import AsyncFLyClient, FLyClient, Infill, build_options
from fly_llm.common.config import FLyConfig
from fly_llm.common.errors import FimUnsupported
from fly_llm.common.fim import MAX_INFILL_CHARS, MAX_INFILL_FILES
from fly_llm.common.protocol import GenerateResult, TokenChunk
from fly_llm.decoding.engine import FLyEngine
from support.blocks import left_block_at
from support.engine_double import serving
from support.http_double import started
from support.tiny_models import greedy_tokens, make_pair

from fly_daemon.http.app import HttpFront, create_app

torch.set_num_threads(1)

TARGET, DRAFT, TOKENIZER = make_pair("llama", fim=True)
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, REPO, SEP = TOKENIZER.convert_tokens_to_ids(
    ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"])
PREFIX, SUFFIX = "def fibonacci(n):\n    if n < 2:\n", "    return fibonacci(n - 1) + fibonacci(n - 2)\n"
MAX_NEW = 12


def plain(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False, split_special_tokens=True)


def middle(ids: list[int]) -> str:
    """The target's own greedy middle for the FIM prompt `ids`, as text."""
    ends = [TOKENIZER.eos_token_id, TOKENIZER.pad_token_id, REPO, SEP]  # <|im_end|>, <|endoftext|>, a new file
    return TOKENIZER.decode(greedy_tokens(TARGET, ids, MAX_NEW, ends), skip_special_tokens=True)


FIM_IDS = [FIM_PREFIX, *plain(PREFIX), FIM_SUFFIX, *plain(SUFFIX), FIM_MIDDLE]
EXPECTED = middle(FIM_IDS)


def endpoint(path) -> str:
    """The ZeroMQ endpoint of the daemon `front(path, ...)` serves."""
    return f"ipc://{path}/s.sock"


@contextmanager
def front(path, engine: FLyEngine):
    with serving(endpoint(path), engine) as server:
        with started(HttpFront(create_app(server.core.inproc), "127.0.0.1:0"), timeout=60) as client:
            yield client


@pytest.fixture(scope="module")
def fim_engine():
    return FLyEngine(TARGET, TOKENIZER, DRAFT, FLyConfig(loose=False, adaptive=False), prefix_cache_bytes=1 << 22,
                     prefix_block=4)


@pytest.fixture(scope="module")
def fim_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fim")


@pytest.fixture(scope="module")
def client(fim_engine, fim_dir):
    with front(fim_dir, fim_engine) as c:
        yield c


@pytest.fixture(scope="module")
def fly(client, fim_dir):
    """FLyClient of the daemon whose HTTP front `client` is on."""
    with FLyClient(endpoint(fim_dir), timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nofim")


@pytest.fixture(scope="module")
def plain_client(plain_dir):
    target, draft, tokenizer = make_pair("llama")
    with front(plain_dir, FLyEngine(target, tokenizer, draft)) as c:
        yield c


@pytest.fixture(scope="module")
def plain_fly(plain_client, plain_dir):
    with FLyClient(endpoint(plain_dir), timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def sse(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_completions_suffix_is_the_targets_greedy_middle(client, model):
    body = {"model": model, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": MAX_NEW, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["text"] == EXPECTED
    assert whole["usage"]["prompt_tokens"] == len(FIM_IDS)
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse(streamed) if c["choices"]) == EXPECTED


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("raw", [False, True])
def test_ollama_generate_with_suffix_fills_in_the_middle(client, model, stream, raw):
    body = {"model": model, "prompt": PREFIX, "suffix": SUFFIX, "raw": raw, "stream": stream,
            "options": {"num_predict": MAX_NEW, "temperature": 0}}
    answer = client.post("/api/generate", json=body)
    lines = [json.loads(line) for line in answer.text.splitlines()]
    assert "".join(line["response"] for line in lines) == EXPECTED
    assert lines[-1]["done"] and lines[-1]["prompt_eval_count"] == len(FIM_IDS)


def test_the_official_clients_send_suffix_unchanged(client, model):
    """The openai SDK's `completions.create(suffix=...)` and the ollama client's `generate(suffix=...)`."""
    sdk = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused")
    answer = sdk.completions.create(model=model, prompt=PREFIX, suffix=SUFFIX, max_tokens=MAX_NEW, temperature=0)
    assert answer.choices[0].text == EXPECTED
    generated = ollama.Client(host=str(client.base_url)).generate(model=model, prompt=PREFIX, suffix=SUFFIX,
                                                                   options={"num_predict": MAX_NEW})
    assert generated.response == EXPECTED


def test_infill_whole_and_streamed_in_llamacpps_shape(client):
    body = {"input_prefix": PREFIX[:10], "prompt": PREFIX[10:], "input_suffix": SUFFIX, "n_predict": MAX_NEW,
            "top_k": 40, "min_p": 0.05, "cache_prompt": True}  # filters change nothing at temperature 0
    whole = client.post("/infill", json=body).json()
    assert whole["content"] == EXPECTED and whole["stop"] is True
    assert whole["tokens_evaluated"] == len(FIM_IDS) and whole["tokens_predicted"] <= MAX_NEW
    assert whole["stop_type"] in ("eos", "limit") and whole["timings"]["predicted_n"] == whole["tokens_predicted"]
    streamed = client.post("/infill", json={**body, "stream": True})
    assert "[DONE]" not in streamed.text
    events = sse(streamed)
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == EXPECTED


# llama.vim's requests as its source (autoload/llama.vim, ggml-org/llama.vim) builds them: a completion, and the
# warm-up it sends every ring_update_ms with the extra context's chunks (`time` is Vim's reltime(), a list).
LLAMA_VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                    "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                    "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]
LLAMA_VIM_EXTRA = [{"text": "def add(a, b):\n    return a + b\n", "time": [1733600000, 123456], "filename": "util.py"}]


def test_llama_vims_completion_is_answered_with_the_fields_it_asks_for(client):
    body = {"input_prefix": PREFIX[:10], "input_suffix": SUFFIX, "input_extra": LLAMA_VIM_EXTRA,
            "prompt": PREFIX[10:], "n_predict": MAX_NEW, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 250, "response_fields": LLAMA_VIM_FIELDS}
    answer = client.post("/infill", json=body)
    assert answer.status_code == 200, answer.text
    fields = answer.json()
    assert list(fields) == LLAMA_VIM_FIELDS  # every one exists, flattened by its path, and nothing else
    assert fields["timings/predicted_n"] >= 1 and fields["truncated"] is False
    assert fields["content"] == client.post("/infill", json={**body, "response_fields": None}).json()["content"]


def test_llama_vims_warm_up_evaluates_the_context_and_answers_no_text(client):
    body = {"input_prefix": "", "input_suffix": "", "input_extra": LLAMA_VIM_EXTRA, "prompt": "", "n_predict": 0,
            "temperature": 0.0, "stream": False, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""]}
    answer = client.post("/infill", json=body)
    assert answer.status_code == 200 and answer.json() == {}, answer.text  # "" names no field
    whole = client.post("/infill", json={**body, "response_fields": None}).json()
    assert whole["content"] == "" and whole["tokens_predicted"] == 0 and whole["tokens_evaluated"] > 0
    streamed = sse(client.post("/infill", json={**body, "response_fields": None, "stream": True}))
    assert "".join(e["content"] for e in streamed) == "" and streamed[-1]["stop"] is True


def test_n_indent_stops_the_middle_where_it_leaves_its_block(client):
    """llama.vim sends its cursor line's indentation as n_indent; the answer is the one without it, cut before
    the first line (after the first) indented less, as llama-server cuts it (issue 64)."""
    body = {"input_prefix": "def f(x):\n    ", "input_suffix": "\n", "n_predict": 60, "temperature": 0,
            "loose": False}  # the tiny model's middle: a first line, then lines indented by 3 spaces
    free = client.post("/infill", json=body).json()["content"]
    shorter = 0
    for n_indent in (2, 4, 8):
        cut = client.post("/infill", json={**body, "n_indent": n_indent}).json()["content"]
        assert cut == left_block_at(free, n_indent), n_indent
        shorter += len(cut) < len(free)
    assert shorter == 2  # 4 and 8 cut it (3 < 4); 2 does not


def test_completion_is_v1_completions_raw_text_in_llamacpps_shape(client, model):
    prompt = "def fibonacci(n):\n"
    expected = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_NEW,
                                                    "temperature": 0}).json()["choices"][0]["text"]
    body = {"prompt": prompt, "n_predict": MAX_NEW, "temperature": 0, "samplers": ["top_k"]}
    whole = client.post("/completion", json=body).json()
    assert whole["content"] == expected and whole["stop"] is True and whole["tokens_evaluated"] == len(plain(prompt))
    events = sse(client.post("/completion", json={**body, "stream": True}))
    assert "".join(e["content"] for e in events) == expected and events[-1]["stop"] is True
    refused = client.post("/completion", json={**body, "input_prefix": "a"})  # /infill's field, not /completion's
    assert refused.status_code == 400 and "not a field /completion serves" in refused.json()["error"]["message"]


def test_infill_puts_other_files_first_in_the_repository_format(client):
    extra = [{"filename": "util.py", "text": "def add(a, b):\n    return a + b\n"}]
    ids = [REPO, *plain("repository\n"), SEP, *plain("util.py\ndef add(a, b):\n    return a + b\n\n"), SEP,
           *plain("\n"), *FIM_IDS]
    whole = client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra,
                                         "n_predict": MAX_NEW}).json()
    assert whole["tokens_evaluated"] == len(ids) and whole["content"] == middle(ids)


def test_show_offers_a_suffix_template_and_insert_only_with_fim_tokens(client, model, plain_client):
    shown = client.post("/api/show", json={"model": model}).json()
    assert ".Suffix" in shown["template"] and "<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>" in shown["template"]
    assert shown["capabilities"] == ["completion", "tools", "insert"]
    other = plain_client.get("/api/tags").json()["models"][0]["name"]
    shown = plain_client.post("/api/show", json={"model": other}).json()
    assert ".Suffix" not in shown["template"] and "insert" not in shown["capabilities"]


def test_consecutive_keystrokes_reuse_the_prefix_cache(client, model, fim_engine):
    """Two requests whose prefixes share a long start: the second is served mostly from cached KV."""
    start = "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
    body = {"model": model, "suffix": "\n", "max_tokens": 2}
    first = client.post("/v1/completions", json={**body, "prompt": start + "        self.it"}).json()
    cached_before = fim_engine.prompt_stats.cached_tokens
    second = client.post("/v1/completions", json={**body, "prompt": start + "        self.items"}).json()
    shared = len([FIM_PREFIX, *plain(start)])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared - 4  # whole blocks of 4
    assert fim_engine.prompt_stats.cached_tokens - cached_before >= shared - 4
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < shared - 4


def test_a_model_without_fim_tokens_is_refused_with_a_stable_code(plain_client):
    other = plain_client.get("/v1/models").json()["data"][0]["id"]
    refused = plain_client.post("/v1/completions", json={"model": other, "prompt": "a", "suffix": "b"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "FIM_UNSUPPORTED"
    assert other in refused.json()["error"]["message"]
    refused = plain_client.post("/api/generate", json={"model": other, "prompt": "a", "suffix": "b"})
    assert refused.status_code == 400 and refused.json()["code"] == "FIM_UNSUPPORTED"
    refused = plain_client.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "FIM_UNSUPPORTED"
    assert plain_client.post("/v1/completions", json={"model": other, "prompt": "a", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("path,body,code", [
    ("/api/generate", {"prompt": "a", "suffix": "b", "system": "s"}, "BAD_REQUEST"),  # FIM has no chat template
    ("/api/generate", {"prompt": "a", "suffix": "b", "template": "{{ .Prompt }}"}, "BAD_REQUEST"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "suffix": "b"}, "BAD_REQUEST"),
    ("/v1/completions", {"prompt": "a", "suffix": "b", "echo": True}, "BAD_REQUEST"),
    ("/infill", {"input_prefix": "a", "mirostat": 2}, "BAD_REQUEST"),  # a sampler FLy does not have
    ("/infill", {"input_prefix": "a", "top_k": -1}, "BAD_REQUEST"),  # out of the sampler's range
    ("/infill", {"input_prefix": "a", "input_sufix": "b"}, "BAD_REQUEST"),  # a typo is refused, not ignored
    ("/infill", {"input_prefix": "a", "input_extra": [{"filename": "f"}]}, "BAD_REQUEST"),  # a file without text
    ("/infill", {"input_prefix": "x" * (MAX_INFILL_CHARS + 1)}, "TOO_LONG"),
    ("/infill", {"input_extra": [{"text": "t"}] * (MAX_INFILL_FILES + 1)}, "TOO_LONG"),
    ("/v1/completions", {"prompt": "a", "suffix": "y" * (MAX_INFILL_CHARS + 1)}, "TOO_LONG"),
    ("/infill", {"input_prefix": "def add(a, b): " * 300}, "TOO_LONG"),  # over the context window in tokens
])
def test_bad_input_is_a_clear_4xx_and_the_daemon_keeps_serving(client, model, path, body, code):
    body = {"model": model, **body} if path != "/infill" else body
    refused = client.post(path, json=body)
    error = refused.json()["error"] if path != "/api/generate" else refused.json()
    assert refused.status_code == 400 and (error["code"] == code), refused.text
    assert client.post("/infill", json={"input_prefix": "a", "n_predict": 1}).status_code == 200


# ---- the ZeroMQ client and the adapters ----

EXTRA = [{"filename": "util.py", "text": "def add(a, b):\n    return a + b\n"}]
GREEDY = build_options(max_tokens=MAX_NEW, temperature=0, loose=False)


def infill_route(client, **fields) -> dict:
    """/infill's whole answer for llama.cpp's `fields`, greedy and at most MAX_NEW tokens."""
    return client.post("/infill", json={"n_predict": MAX_NEW, "temperature": 0, **fields}).json()


def streamed(items) -> tuple[str, GenerateResult]:
    """The text of a stream's chunks and its final result (which comes last, after chunks only)."""
    *chunks, final = items
    assert isinstance(final, GenerateResult) and all(isinstance(c, TokenChunk) for c in chunks)
    return "".join(c.text for c in chunks), final


def test_client_infill_is_the_infill_routes_answer(client, fly):
    """The same request through FLyClient.infill and /infill: the same middle, prompt and counts (other
    files first, in the repository format), and the target's own greedy middle."""
    for files in ([], EXTRA):
        route = infill_route(client, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=files)
        result = fly.infill(PREFIX, SUFFIX, files=files, sampling=GREEDY[0], fly=GREEDY[1])
        assert result.text == route["content"] and result.text.strip()
        assert result.usage.prompt_tokens == route["tokens_evaluated"]
        assert result.usage.completion_tokens == route["tokens_predicted"] == len(result.token_ids)
    assert result.text == middle([REPO, *plain("repository\n"), SEP, *plain(
        "util.py\ndef add(a, b):\n    return a + b\n\n"), SEP, *plain("\n"), *FIM_IDS])


def test_client_suffix_stream_and_batch_fill_in_the_middle(fly):
    """OpenAI's `suffix` on generate, stream and batch; an Infill as the prompt; the chunks add up to the result."""
    assert fly.generate(PREFIX, *GREEDY, suffix=SUFFIX).text == EXPECTED
    text, final = streamed(list(fly.stream(PREFIX, sampling=GREEDY[0], fly=GREEDY[1], suffix=SUFFIX)))
    assert text == final.text == EXPECTED and final.usage.prompt_tokens == len(FIM_IDS)
    text, _ = streamed(list(fly.stream(Infill(prefix=PREFIX, suffix=SUFFIX, files=EXTRA), sampling=GREEDY[0],
                                       fly=GREEDY[1])))
    assert text == fly.infill(PREFIX, SUFFIX, files=EXTRA, sampling=GREEDY[0], fly=GREEDY[1]).text
    both = fly.batch([PREFIX, PREFIX[:10]], *GREEDY, suffix=SUFFIX)
    assert both[0].text == EXPECTED and both[1].usage.prompt_tokens == len(
        [FIM_PREFIX, *plain(PREFIX[:10]), FIM_SUFFIX, *plain(SUFFIX), FIM_MIDDLE])
    assert fly.generate(PREFIX, *GREEDY).usage.prompt_tokens == len(plain(PREFIX))  # no suffix: plain completion
    with pytest.raises(TypeError, match="suffix goes with a prompt string"):
        next(fly.stream(messages=[{"role": "user", "content": "x"}], suffix=SUFFIX))
    assert fly.info().fill_in_middle


async def test_async_client_fills_in_the_middle(fim_dir, client):
    async with AsyncFLyClient(endpoint(fim_dir), timeout=60) as aclient:
        assert (await aclient.infill(PREFIX, SUFFIX, sampling=GREEDY[0], fly=GREEDY[1])).text == EXPECTED
        assert (await aclient.generate(PREFIX, *GREEDY, suffix=SUFFIX)).text == EXPECTED
        items = [item async for item in aclient.stream(PREFIX, sampling=GREEDY[0], fly=GREEDY[1], suffix=SUFFIX)]
        assert streamed(items)[0] == EXPECTED


def test_the_client_gets_fim_unsupported_for_a_model_without_fim_tokens(plain_fly):
    assert not plain_fly.info().fill_in_middle
    for call in (lambda: plain_fly.infill("a", "b"), lambda: plain_fly.generate("a", suffix="b"),
                 lambda: list(plain_fly.stream("a", suffix="b")), lambda: plain_fly.batch(["a"], suffix="b")):
        with pytest.raises(FimUnsupported) as refused:
            call()
        assert refused.value.code == "FIM_UNSUPPORTED" and "fill-in-the-middle" in refused.value.message
    assert plain_fly.generate("a", build_options(max_tokens=2)[0]).usage.completion_tokens <= 2  # still serving


def test_langchain_llm_passes_suffix_on(fim_dir, plain_dir, plain_client):
    from langchain_fly import ChatFLy, FLyLLM

    llm = FLyLLM(endpoint=endpoint(fim_dir), max_tokens=MAX_NEW, temperature=0, loose=False)
    assert llm.invoke(PREFIX, suffix=SUFFIX) == EXPECTED
    assert "".join(llm.stream(PREFIX, suffix=SUFFIX)) == EXPECTED
    assert llm.batch([PREFIX, PREFIX], suffix=SUFFIX) == [EXPECTED, EXPECTED]
    streaming = FLyLLM(endpoint=endpoint(fim_dir), max_tokens=MAX_NEW, temperature=0, loose=False, streaming=True)
    assert streaming.invoke(PREFIX, suffix=SUFFIX) == EXPECTED
    assert llm.invoke(PREFIX) != EXPECTED  # without it: a plain completion of the prefix
    with pytest.raises(FimUnsupported):
        FLyLLM(endpoint=endpoint(plain_dir), max_tokens=2).invoke("a", suffix="b")
    with pytest.raises(TypeError, match="suffix"):
        ChatFLy(endpoint=endpoint(fim_dir), max_tokens=2).invoke("a", suffix="b")


async def test_langchain_llm_passes_suffix_on_async(fim_dir, client):
    from langchain_fly import FLyLLM

    llm = FLyLLM(endpoint=endpoint(fim_dir), max_tokens=MAX_NEW, temperature=0, loose=False)
    assert await llm.ainvoke(PREFIX, suffix=SUFFIX) == EXPECTED
    assert "".join([chunk async for chunk in llm.astream(PREFIX, suffix=SUFFIX)]) == EXPECTED


def test_llama_index_complete_passes_suffix_on(fim_dir, plain_dir, plain_client):
    from llama_index.llms.fly import FLyLLM

    llm = FLyLLM(endpoint=endpoint(fim_dir), max_tokens=MAX_NEW, temperature=0, loose=False)
    assert llm.complete(PREFIX, suffix=SUFFIX).text == EXPECTED
    assert [r.text for r in llm.stream_complete(PREFIX, suffix=SUFFIX)][-1] == EXPECTED
    with pytest.raises(FimUnsupported):
        FLyLLM(endpoint=endpoint(plain_dir), max_tokens=2).complete("a", suffix="b")
