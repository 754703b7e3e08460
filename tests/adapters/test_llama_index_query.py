"""FLyLLM inside LlamaIndex: a VectorStoreIndex query engine answering through the tiny-model daemon.

The documents are real sentences built here; the embedding is LlamaIndex's MockEmbedding (retrieval
quality is not under test, the LLM's part of the pipeline is).
"""

from __future__ import annotations

import pytest
from llama_index.core import Document, MockEmbedding, PromptTemplate, Settings, VectorStoreIndex
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from test_llama_index import llm_events  # noqa: F401  (fixture: the LLM end events of a test)

from llama_index.llms.fly import FLyLLM

DOCUMENTS = [
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "FLy accepts a draft token that differs from the target when the next draft tokens agree.",
    "The entropy gate rejects a mismatch where the target model is confident.",
    "Paris is the capital of France and sits on the river Seine.",
]
QUESTION = "How does speculative decoding verify draft tokens?"
# The tiny model's window is 512 tokens of a byte-level tokenizer (about 4x tiktoken's count), too
# small for LlamaIndex's default QA prompt (a long system message) and for the refine modes (500
# tokens of padding): one short prompt over the retrieved chunks.
QA_TEMPLATE = PromptTemplate("Context:\n{context_str}\nQuestion: {query_str}\nAnswer:")
ENGINE = {"similarity_top_k": 2, "text_qa_template": QA_TEMPLATE, "response_mode": "simple_summarize"}


@pytest.fixture(scope="module")
def index() -> VectorStoreIndex:
    return VectorStoreIndex.from_documents([Document(text=t) for t in DOCUMENTS],
                                           embed_model=MockEmbedding(embed_dim=16))


@pytest.fixture(scope="module")
def llm(tiny_daemon) -> FLyLLM:
    return FLyLLM(endpoint=tiny_daemon, max_tokens=16)


@pytest.fixture(scope="module")
def answer(index, llm) -> str:
    """The non-streaming answer: the reference the other ways of querying must reproduce (greedy)."""
    answer = index.as_query_engine(llm=llm, **ENGINE).query(QUESTION).response
    assert answer, "the tiny model should write something"
    return answer


def test_query_engine_answers_from_retrieved_context(index, llm, llm_events):
    response = index.as_query_engine(llm=llm, **ENGINE).query(QUESTION)
    assert len(response.source_nodes) == 2
    chats = [e for e in llm_events if isinstance(e, LLMChatEndEvent)]
    assert len(chats) == 1
    prompt = "\n".join(m.content for m in chats[0].messages)
    assert QUESTION in prompt
    assert all(node.get_content() in prompt for node in response.source_nodes)
    assert response.response == chats[0].response.message.content


def test_streaming_query_deltas_concatenate_to_the_answer(index, llm, answer):
    engine = index.as_query_engine(llm=llm, **ENGINE, streaming=True)
    response = engine.query(QUESTION)
    assert "".join(response.response_gen) == answer


async def test_aquery_gives_the_same_answer(index, llm, answer):
    engine = index.as_query_engine(llm=llm, **ENGINE)
    assert (await engine.aquery(QUESTION)).response == answer


async def test_async_streaming_query(index, llm, answer):
    engine = index.as_query_engine(llm=llm, **ENGINE, streaming=True)
    response = await engine.aquery(QUESTION)
    assert "".join([delta async for delta in response.async_response_gen()]) == answer


def test_settings_llm_is_used(index, llm, answer, llm_events, monkeypatch):
    monkeypatch.setattr(Settings, "_llm", None)
    Settings.llm = llm
    engine = index.as_query_engine(**ENGINE)
    assert engine.query(QUESTION).response == answer
    chats = [e for e in llm_events if isinstance(e, LLMChatEndEvent)]
    assert len(chats) == 1
