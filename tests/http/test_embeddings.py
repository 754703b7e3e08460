"""The embedding routes (/v1/embeddings, /api/embed, /api/embeddings) of a tiny daemon with a tiny BERT encoder.

Unchanged client code: the openai SDK (base64 by default, and float), LangChain's OpenAIEmbeddings and
OllamaEmbeddings, LlamaIndex's OpenAIEmbedding and OllamaEmbedding. Every vector is checked against the
model's own output computed directly with transformers (tests/support/tiny_embedder.py); bad inputs get
4xx with stable codes in each API's error shape.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from support.daemon_process import serving_http
from support.tiny_embedder import DIMENSIONS, MAX_SEQ_LENGTH, reference, save_tiny_embedder

TEXTS = ["the quick brown fox", "lisp startup essay", "jumps over the lazy dog", "", "retrieval 42"]
LONG = "the quick brown fox jumps " * 20  # far over the tiny encoder's MAX_SEQ_LENGTH tokens
TOLERANCE = 1e-5
NAME = "tiny_embedder"


@pytest.fixture(scope="module")
def served(tiny_pair_dirs, tmp_path_factory):
    """(base URL, embedder directory) of a daemon serving the tiny pair and the tiny encoder over HTTP."""
    work = tmp_path_factory.mktemp("embeddings")
    encoder = save_tiny_embedder(work / NAME)
    flags = ("--embedding-model", str(encoder), "--embedding-batch-size", "3")
    with serving_http(*tiny_pair_dirs, work, "e", *flags) as (_, url):
        yield url, encoder


def close(vectors, expected) -> None:
    assert np.allclose(np.asarray(vectors, dtype=np.float64), expected.numpy(), atol=TOLERANCE)


def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served[0]}{path}", json=body, timeout=60)


def test_openai_sdk_base64_and_float(served):
    from openai import OpenAI

    client = OpenAI(base_url=f"{served[0]}/v1", api_key="unused")
    expected = reference(served[1], TEXTS)
    by_default = client.embeddings.create(model=NAME, input=TEXTS)  # the SDK asks for base64 and decodes it
    floats = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    for answer in (by_default, floats):
        assert [d.index for d in answer.data] == list(range(len(TEXTS)))
        close([d.embedding for d in answer.data], expected)
        assert answer.model == NAME
    raw = post(served, "/v1/embeddings", {"model": NAME, "input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    close([decoded], expected[:1])


def test_usage_counts_every_token_with_the_special_ones(served):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served[1])
    answer = post(served, "/v1/embeddings", {"model": NAME, "input": TEXTS}).json()
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    ollama = post(served, "/api/embed", {"model": NAME, "input": TEXTS}).json()
    assert ollama["prompt_eval_count"] == tokens and ollama["total_duration"] > 0


def test_token_ids_embed_as_their_text(served):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served[1])
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:3]]
    expected = reference(served[1], TEXTS[:3])
    many = post(served, "/v1/embeddings", {"model": NAME, "input": ids}).json()
    close([d["embedding"] for d in many["data"]], expected)
    one = post(served, "/v1/embeddings", {"model": NAME, "input": ids[0]}).json()
    close([one["data"][0]["embedding"]], expected[:1])


def test_ollama_embed_without_input_loads_and_embeds_nothing(served):
    """As Ollama answers its load request (issue 65: one vector came back, of an empty text)."""
    for body in ({"model": NAME}, {"model": NAME, "input": ""}, {"model": NAME, "input": []}):
        answer = post(served, "/api/embed", body)
        assert answer.status_code == 200 and answer.json()["embeddings"] == [], answer.text
    assert post(served, "/api/embed", {"model": "nomic-embed-text"}).status_code == 404


def test_ollama_show_describes_the_embedding_model_tags_lists(served):
    listed = [m["name"] for m in httpx.get(f"{served[0]}/api/tags", timeout=30).json()["models"]]
    assert NAME in listed
    shown = post(served, "/api/show", {"model": NAME})
    assert shown.status_code == 200 and shown.json()["capabilities"] == ["embedding"], shown.text


def test_another_tokenizers_ids_are_refused_with_the_fix(served):
    """LangChain's OpenAIEmbeddings at its defaults sends tiktoken (cl100k) ids: `[9906, 1917, 50256]` is
    "Hello world" and more, from a vocabulary three times the encoder's; the 400 names the setting to change."""
    refused = post(served, "/v1/embeddings", {"model": NAME, "input": [[9906, 1917, 50256]]})
    assert refused.status_code == 400
    assert "check_embedding_ctx_length=False" in refused.json()["error"]["message"]


def test_langchain_openai_and_ollama_embeddings(served):
    from langchain_ollama import OllamaEmbeddings
    from langchain_openai import OpenAIEmbeddings

    expected = reference(served[1], TEXTS)
    openai = OpenAIEmbeddings(model=NAME, base_url=f"{served[0]}/v1", api_key="unused",
                              check_embedding_ctx_length=False)
    ollama = OllamaEmbeddings(model=NAME, base_url=served[0])
    for client in (openai, ollama):
        close(client.embed_documents(TEXTS), expected)
        close([client.embed_query(TEXTS[0])], expected[:1])


def test_llama_index_openai_and_ollama_embedding(served):
    from llama_index.embeddings.ollama import OllamaEmbedding
    from llama_index.embeddings.openai import OpenAIEmbedding

    expected = reference(served[1], TEXTS)
    openai = OpenAIEmbedding(model_name=NAME, api_base=f"{served[0]}/v1", api_key="unused", embed_batch_size=2)
    ollama = OllamaEmbedding(model_name=NAME, base_url=served[0], embed_batch_size=2)
    for client in (openai, ollama):
        close(client.get_text_embedding_batch(TEXTS), expected)
        close([client.get_query_embedding(TEXTS[1])], expected[1:2])


def test_over_long_inputs_cut_where_the_api_says_else_refused(served):
    cut = reference(served[1], [LONG], MAX_SEQ_LENGTH)
    close(post(served, "/api/embed", {"model": NAME, "input": LONG}).json()["embeddings"], cut)
    close([post(served, "/api/embeddings", {"model": NAME, "prompt": LONG}).json()["embedding"]], cut)
    refused = post(served, "/api/embed", {"model": NAME, "input": [TEXTS[0], LONG], "truncate": False})
    assert refused.status_code == 400 and refused.json()["code"] == "TOO_LONG"
    openai = post(served, "/v1/embeddings", {"model": NAME, "input": [LONG]})
    assert openai.status_code == 400 and openai.json()["error"]["code"] == "TOO_LONG"
    assert f"over the embedding model's {MAX_SEQ_LENGTH}" in openai.json()["error"]["message"]


def test_ollama_routes_take_any_content_type_and_older_aliases(served):
    body = '{"model": "tiny_embedder:latest", "input": "the quick brown fox"}'
    answer = httpx.post(f"{served[0]}/api/embed", content=body,
                        headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)  # curl -d
    assert answer.status_code == 200
    close(answer.json()["embeddings"], reference(served[1], [TEXTS[0]]))
    assert post(served, "/api/embed", {"model": NAME, "input": []}).json()["embeddings"] == []


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("/v1/embeddings", {"model": "text-embedding-3-small", "input": "x"}, 404, "BAD_REQUEST"),
    ("/v1/embeddings", {"model": NAME, "input": []}, 400, "BAD_REQUEST"),
    ("/v1/embeddings", {"model": NAME, "input": [[]]}, 200, None),
    ("/v1/embeddings", {"model": NAME, "input": [1, -1]}, 400, "BAD_REQUEST"),
    ("/v1/embeddings", {"model": NAME, "input": [[1], [10**6]]}, 400, "BAD_REQUEST"),
    ("/v1/embeddings", {"model": NAME, "input": [1.5]}, 400, "BAD_REQUEST"),
    ("/v1/embeddings", {"model": NAME, "input": ["x", 1]}, 400, "BAD_REQUEST"),
    ("/v1/embeddings", {"model": NAME, "input": ["x"] * 2049}, 400, "TOO_LONG"),
    ("/v1/embeddings", {"model": NAME, "input": "x", "encoding_format": "hex"}, 400, "BAD_REQUEST"),
    ("/v1/embeddings", {"model": NAME, "input": "x", "dimensions": 8}, 400, "BAD_REQUEST"),
    ("/v1/embeddings", {"model": NAME, "input": "x", "dimensions": DIMENSIONS}, 200, None),
    ("/v1/embeddings", {"model": NAME, "input": "x", "bogus": 1}, 400, "BAD_REQUEST"),
    ("/v1/embeddings", {"input": "x"}, 400, "BAD_REQUEST"),
    ("/api/embed", {"model": "llama3", "input": "x"}, 404, "BAD_REQUEST"),
    ("/api/embed", {"model": NAME, "input": 7}, 400, "BAD_REQUEST"),
    ("/api/embed", {"model": NAME, "input": "x", "truncate": "no"}, 400, "BAD_REQUEST"),
    ("/api/embed", {"model": NAME, "input": "x", "dimensions": 8}, 400, "BAD_REQUEST"),
    ("/api/embed", {"model": NAME, "input": ["x"] * 2049}, 400, "TOO_LONG"),
    ("/api/embeddings", {"model": NAME, "prompt": ["x"]}, 400, "BAD_REQUEST"),
    ("/api/embeddings", {"prompt": "x"}, 400, "BAD_REQUEST"),
])
def test_bad_inputs_get_stable_codes_in_each_apis_shape(served, path, body, status, code):
    answer = post(served, path, body)
    assert answer.status_code == status, answer.text
    if code is not None:
        error = answer.json()["error"] if path.startswith("/v1") else answer.json()
        assert error["code"] == code and error.get("message", error.get("error"))
    assert httpx.get(f"{served[0]}/health", timeout=10).status_code == 200


def test_not_json_is_refused_in_each_shape(served):
    openai = httpx.post(f"{served[0]}/v1/embeddings", content=b"{", headers={"content-type": "application/json"})
    ollama = httpx.post(f"{served[0]}/api/embed", content=b"{")
    assert (openai.status_code, openai.json()["error"]["code"]) == (400, "BAD_REQUEST")
    assert (ollama.status_code, ollama.json()["code"]) == (400, "BAD_REQUEST")


@pytest.mark.parametrize("path", ["/v1/embeddings", "/api/embed", "/api/embeddings"])
@pytest.mark.parametrize("text", ["a\\ud83dz", "\\udc00", "\\ufffd\\u0301\\u0000\\ud83d"])
def test_a_lone_surrogate_is_not_json_text(served, path, text):
    """The hostile fuzzer's finding (benchmarks/results/hostile-fuzz/issue45): a lone surrogate escape passed
    the OpenAI route's JSON reader and failed in the tokenizer, HTTP 500. Every route reads bodies as the
    ZeroMQ frames do (fly_llm.common.json_text): it is not valid JSON text, 400 BAD_REQUEST."""
    field = "prompt" if path == "/api/embeddings" else "input"
    body = f'{{"model": "{NAME}", "{field}": ["{text}"]}}' if path == "/v1/embeddings" else \
        f'{{"model": "{NAME}", "{field}": "{text}"}}'
    answer = httpx.post(f"{served[0]}{path}", content=body.encode(), headers={"content-type": "application/json"})
    error = answer.json()["error"] if path.startswith("/v1") else answer.json()
    assert (answer.status_code, error["code"]) == (400, "BAD_REQUEST"), answer.text
    assert "not valid JSON" in error.get("message", error.get("error"))
