"""Mask time per token of llguidance vs xgrammar on the embedded target's tokenizer (why fly-llm uses llguidance).

    pip install llguidance xgrammar   # xgrammar is not a fly-llm dependency: it pulls triton (~290 MB)
    python benchmarks/engine/grammar_libraries.py

Both compute the allowed-token bitmask for a JSON Schema along one answer, five passes (the
first, warm-up pass is dropped); prints median / mean / p99 microseconds per mask.
"""

from __future__ import annotations

import json
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.torch
import xgrammar
from transformers import AutoTokenizer

from fly_llm.model.embedded import ensure_default_pair

SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "number"}},
          "required": ["reasoning", "answer"], "additionalProperties": False}
ANSWER = '{"reasoning": "We add two and three to get five, so the answer is five.", "answer": 5}'


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_pair()[0])
    vocab = len(tokenizer)
    ids = tokenizer.encode(ANSWER)
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    ll_grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    xg_grammar = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)) \
        .compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    times: dict[str, list[float]] = {"llguidance": [], "xgrammar": []}
    for _ in range(5):
        matcher, bitmask = llguidance.LLMatcher(ll_tokenizer, ll_grammar), llguidance.torch.allocate_token_bitmask(1, vocab)
        for token in ids:
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
            times["llguidance"].append(time.perf_counter() - start)
            matcher.consume_token(token)
        matcher, bitmask = xgrammar.GrammarMatcher(xg_grammar), xgrammar.allocate_token_bitmask(1, vocab)
        for token in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times["xgrammar"].append(time.perf_counter() - start)
            matcher.accept_token(token)
    for name, values in times.items():
        values = sorted(values[len(ids):])
        print(f"{name}: median {1e6 * statistics.median(values):.0f} us, mean {1e6 * statistics.mean(values):.0f} us, "
              f"p99 {1e6 * values[int(0.99 * len(values))]:.0f} us per mask ({len(values)} masks)")


if __name__ == "__main__":
    main()
