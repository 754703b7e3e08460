"""Structured output and tool calls on the embedded pair: target-only vs exact SPD vs FLy, all under the grammar.

    python benchmarks/engine/structured_bench.py --limit 4 --max-tokens 192 --threads 2 --out benchmarks/results/structured

Two tasks, each item decoded greedily by every method in turn (so noise hits all methods alike):
- gsm8k-json: GSM8K problems answered as {"reasoning": str, "answer": number} (JSON Schema);
  scored by the answer against the reference;
- tool-calls: requests that need one of two tools (tool_choice "required"); scored by the tool
  named being the expected one.
Methods: `target` (HF `generate` with fly-llm's grammar logits processor), `spd` and `fly`
(FLyEngine, exact and loose). Reported per task and method: tokens/s and speedup over target,
MAT, the share of output tokens the grammar forced, validity (must be 100%), accuracy, retention
(accuracy / target's) and how many outputs equal the target's token for token. Each finished item
is appended to OUT/items.jsonl, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jsonschema

from benchmarks.harness.datasets import load
from benchmarks.harness.methods import Runner, all_methods
from benchmarks.harness.quality import _to_float
from fly_llm.common.tool_formats.hermes import split_tool_calls
from fly_llm.common.tools import Structure

METHODS = ("target", "spd", "fly")
ANSWER_SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 600},
                                                  "answer": {"type": "number"}},
                 "required": ["reasoning", "answer"], "additionalProperties": False}
JSON_INSTRUCTION = ("Solve the problem. Reply with a JSON object: a short step-by-step 'reasoning' and the final "
                    "numeric 'answer'.\n\nProblem: {question}")
TOOLS = [
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                      "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                     "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
]
TOOL_PROMPTS = [
    ("What is 1234 * 5678?", "calculator"),
    ("How warm is it in Paris right now, in celsius?", "get_weather"),
    ("Compute (17 + 25) / 6 for me.", "calculator"),
    ("Is it snowing in Oslo? Use fahrenheit.", "get_weather"),
    ("What's the square of 91?", "calculator"),
    ("Weather report for Tokyo please, metric units.", "get_weather"),
]


def tasks(limit: int) -> list[dict[str, Any]]:
    """The items: id, task, chat messages, structure, and what a correct answer is."""
    items = [{"id": item.item_id, "task": "gsm8k-json",
              "messages": [{"role": "user", "content": JSON_INSTRUCTION.format(
                  question=item.messages[0]["content"].split("Question: ", 1)[1])}],
              "structure": {"response_format": {"type": "json_schema", "schema": ANSWER_SCHEMA}},
              "expected": item.reference["answer"]} for item in load("gsm8k", limit)]
    items += [{"id": f"tools/{i}", "task": "tool-calls", "messages": [{"role": "user", "content": prompt}],
               "structure": {"tools": TOOLS, "tool_choice": "required"}, "expected": tool}
              for i, (prompt, tool) in enumerate(TOOL_PROMPTS[:limit])]
    return items


def judge(item: dict[str, Any], text: str) -> tuple[bool, bool]:
    """(valid, correct) for one output."""
    if item["task"] == "gsm8k-json":
        try:
            answer = json.loads(text)
            jsonschema.validate(answer, ANSWER_SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False, False
        return True, answer["answer"] == _to_float(item["expected"])
    content, calls = split_tool_calls(text)
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    try:
        valid = bool(calls) and not content and all(jsonschema.validate(c.arguments, specs[c.name]) is None
                                                    for c in calls)
    except (KeyError, jsonschema.ValidationError):
        valid = False
    return valid, valid and calls[0].name == item["expected"]


def run(args: argparse.Namespace) -> Path:
    """Decode every item with every method (resuming from OUT/items.jsonl); return that file."""
    import torch

    from fly_llm.common.config import ModelSpec
    from fly_llm.model.pair import load_models

    if args.threads:
        torch.set_num_threads(args.threads)
    models = load_models(ModelSpec(target=args.target, draft=args.draft, dtype=args.dtype))
    runner = Runner(models.target, models.tokenizer, models.draft, args.max_tokens, models.context_window)
    methods = all_methods()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "items.jsonl"
    done = {(r["id"], r["method"]) for r in _rows(path)}
    with path.open("a", encoding="utf-8") as sink:
        for item in tasks(args.limit):
            structure = Structure.model_validate(item["structure"])
            prompt = runner.engine.encode(messages=item["messages"], tools=item["structure"].get("tools"))
            for name in METHODS:
                if (item["id"], name) in done:
                    continue
                result = runner.run(methods[name], prompt, structure=structure)
                text = models.tokenizer.decode(result.token_ids, skip_special_tokens=False)
                valid, correct = judge(item, text)
                sink.write(json.dumps({
                    "id": item["id"], "task": item["task"], "method": name, "tokens": result.token_ids,
                    "seconds": result.seconds, "target_forwards": result.target_forwards,
                    "forced": result.stats.forced if result.stats else 0, "valid": valid, "correct": correct,
                    "text": text}) + "\n")
                sink.flush()
                print(f"{item['id']:>14} {name:>6}: {len(result.token_ids):4d} tokens in {result.seconds:6.1f} s, "
                      f"valid={valid} correct={correct}", flush=True)
    return path


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task and method: speed, MAT, forced share, validity, accuracy, retention, identical outputs."""
    summaries = []
    for task in dict.fromkeys(r["task"] for r in rows):
        target = {r["id"]: r for r in rows if r["task"] == task and r["method"] == "target"}
        for method in METHODS:
            mine = [r for r in rows if r["task"] == task and r["method"] == method and r["id"] in target]
            if not mine:
                continue
            tokens = sum(len(r["tokens"]) for r in mine)
            seconds = sum(r["seconds"] for r in mine)
            base = [target[r["id"]] for r in mine]
            accuracy = sum(r["correct"] for r in mine) / len(mine)
            base_accuracy = sum(r["correct"] for r in base) / len(base)
            summaries.append({
                "task": task, "method": method, "items": len(mine), "tokens": tokens,
                "tokens_per_s": tokens / seconds,
                "speedup": (tokens / seconds) / (sum(len(r["tokens"]) for r in base) / sum(r["seconds"] for r in base)),
                "mat": tokens / max(1, sum(r["target_forwards"] for r in mine)),
                "forced_share": sum(r["forced"] for r in mine) / max(1, tokens),
                "valid": sum(r["valid"] for r in mine) / len(mine), "accuracy": accuracy,
                "retention": accuracy / base_accuracy if base_accuracy else None,
                "same_as_target": sum(r["tokens"] == target[r["id"]]["tokens"] for r in mine) / len(mine)})
    return summaries


def markdown(summaries: list[dict[str, Any]], command: str) -> str:
    """The summary as a Markdown table, with the command that produced it."""
    lines = [f"`{command}`", "", "| task | method | items | tok/s | speedup | MAT | forced | valid | accuracy | "
             "retention | = target |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        retention = "–" if s["retention"] is None else f"{s['retention']:.0%}"
        lines.append(f"| {s['task']} | {s['method']} | {s['items']} | {s['tokens_per_s']:.2f} | {s['speedup']:.2f}× | "
                     f"{s['mat']:.2f} | {s['forced_share']:.0%} | {s['valid']:.0%} | {s['accuracy']:.0%} | "
                     f"{retention} | {s['same_as_target']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run (or resume) the benchmark and write OUT/results.json and OUT/results.md."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=4, help="items per task")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--target", default=None, help="target model (HF id, local dir, .gguf); default: embedded")
    p.add_argument("--draft", default=None, help="draft model; default: embedded")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("structured-bench-results"))
    args = p.parse_args(argv)
    command = shlex.join(["python", "benchmarks/engine/structured_bench.py", *(sys.argv[1:] if argv is None else argv)])
    summaries = summarize(_rows(run(args)))
    (args.out / "results.json").write_text(json.dumps({
        "command": command, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {"limit": args.limit, "max_tokens": args.max_tokens, "dtype": args.dtype, "greedy": True},
        "results": summaries}, indent=2), encoding="utf-8")
    (args.out / "results.md").write_text(markdown(summaries, command), encoding="utf-8")
    print(markdown(summaries, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
