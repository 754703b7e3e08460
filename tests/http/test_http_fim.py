"""Fill-in-the-middle on every door of the HTTP front, in-process on a tiny pair whose tokenizer has
Qwen2.5-Coder's FIM tokens (exact mode, prefix cache on), and refusals on one whose tokenizer has none.

`suffix` on /v1/completions and /api/generate, llama.cpp's /infill (whole and streamed), /api/show's
template with `.Suffix` and the `insert` capability; each answer is the target's own greedy middle for the
FIM prompt written out by hand; consecutive keystrokes reuse the prefix cache; bad input gets a clear 4xx.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import ollama
import openai
import pytest
import torch

from fly_llm.common.config import FLyConfig
from fly_llm.common.fim import MAX_INFILL_CHARS, MAX_INFILL_FILES
from fly_llm.decoding.engine import FLyEngine
from support.engine_double import serving
from support.tiny_models import greedy_tokens, make_pair

from fly_daemon.http import HttpFront, create_app

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


@contextmanager
def front(path, engine: FLyEngine):
    with serving(f"ipc://{path}/s.sock", engine) as server:
        http = HttpFront(create_app(server.core.inproc), "127.0.0.1:0")
        http.start()
        try:
            with httpx.Client(base_url=http.url, timeout=60) as client:
                yield client
        finally:
            http.stop()


@pytest.fixture(scope="module")
def fim_engine():
    return FLyEngine(TARGET, TOKENIZER, DRAFT, FLyConfig(loose=False, adaptive=False), prefix_cache_bytes=1 << 22,
                     prefix_block=4)


@pytest.fixture(scope="module")
def client(fim_engine, tmp_path_factory):
    with front(tmp_path_factory.mktemp("fim"), fim_engine) as c:
        yield c


@pytest.fixture(scope="module")
def plain_client(tmp_path_factory):
    target, draft, tokenizer = make_pair("llama")
    with front(tmp_path_factory.mktemp("nofim"), FLyEngine(target, tokenizer, draft)) as c:
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
