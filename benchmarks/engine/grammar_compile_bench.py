"""First and second compile of an agent's tool list (issue 33: "the second turn must pay nothing").

    python benchmarks/engine/grammar_compile_bench.py                 # the embedded target's tokenizer (Qwen2.5)
    python benchmarks/engine/grammar_compile_bench.py --tokenizer DIR # any Hugging Face tokenizer directory

An agent re-sends the same tools every turn. This times, on one `GrammarCompiler` (with its
sacrificial sandbox, as the daemon runs it): building llguidance's tokenizer view, starting the
sandbox worker, the first compile of `--tools` realistic tools (nested parameters with `$defs`,
arrays, enums) and the median and worst of `--repeats` later compiles of equal tool lists sent as new
requests. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from fly_llm.decoding.grammar import GrammarCompiler
from fly_llm.common.tool_formats import Constraints
from fly_llm.common.tool_formats.hermes import HERMES
from fly_llm.common.tools import Structure


def agent_tools(n: int) -> list[dict]:
    """`n` realistic OpenAI-style tools with nested parameters (a `$defs` model, arrays, enums)."""
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool number {i}.",
        "parameters": {
            "$defs": {"Filter": {"type": "object", "properties": {
                "field": {"type": "string", "enum": ["name", "date", "size", "owner"]},
                "op": {"type": "string", "enum": ["eq", "lt", "gt", "contains"]},
                "value": {"anyOf": [{"type": "string"}, {"type": "number"}]}},
                "required": ["field", "op", "value"], "additionalProperties": False}},
            "type": "object", "properties": {
                "query": {"type": "string", "description": "What to look for."},
                "filters": {"type": "array", "items": {"$ref": "#/$defs/Filter"}, "maxItems": 5},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                "options": {"type": "object", "properties": {
                    "sort": {"type": "string", "enum": ["asc", "desc"]}, "verbose": {"type": "boolean"}},
                    "required": ["sort"], "additionalProperties": False}},
            "required": ["query", "filters", "limit"], "additionalProperties": False}}} for i in range(n)]


def _embedded_tokenizer_dir() -> str:
    from fly_llm.model.embedded import TARGET, ensure_embedded
    from fly_llm.model.pair import resolve_source

    return resolve_source(str(ensure_embedded(TARGET)))


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default: the embedded target's)")
    p.add_argument("--tools", type=int, default=20)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or _embedded_tokenizer_dir())
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    start = time.perf_counter()
    constraints = Constraints(HERMES, compiler.special_tokens)
    compiler.tokenizer, compiler.special_tokens(HERMES.tags)
    view = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher('start: "warm"')  # starts the sandbox worker
    worker = time.perf_counter() - start
    start = time.perf_counter()
    compiler.for_constraint(constraints.constraint(Structure(tools=agent_tools(args.tools), tool_choice="auto")))
    first = time.perf_counter() - start
    later = []
    for _ in range(args.repeats):
        structure = Structure(tools=agent_tools(args.tools), tool_choice="auto")  # a new request, same tools
        start = time.perf_counter()
        compiler.for_constraint(constraints.constraint(structure))
        later.append(time.perf_counter() - start)
    print(json.dumps({
        "cpu": platform.processor() or platform.machine(), "vocab": len(tokenizer), "tools": args.tools,
        "tokenizer_view_ms": _ms(view), "sandbox_start_ms": _ms(worker), "first_compile_ms": _ms(first),
        "second_compile_median_ms": _ms(statistics.median(later)), "second_compile_max_ms": _ms(max(later))}))


if __name__ == "__main__":
    main()
