"""Constrained decoding inside speculation: validity, exactness against HF generate, forced tokens.

The tiny models have random weights, so only the grammar makes their output valid: every check
here fails if masking, draft cutting or the matchers' bookkeeping breaks.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.grammar import grammar_of
from fly_llm.common.errors import BadRequest
from fly_llm.common.tool_formats import Constraints
from fly_llm.common.tool_formats.hermes import HERMES, split_tool_calls
from fly_llm.common.tools import Structure
from support.grammar_reference import constrained_greedy, grammar_valid_prefix
from support.structures import constraint_of, schema_structure
from support.tiny_models import make_pair

torch.set_num_threads(1)

SCHEMAS = {
    "enum_bool": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
                  "required": ["color", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                    "adult": {"type": "boolean"}},
                   "required": ["name", "adult"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "bounded_array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "boolean"}, {"enum": ["x", "y"]}, {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False},
}
PROMPTS = ["def add(a, b):", "The quick brown fox", "Question: what is 2 + 3?", "x"]


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama")


def engine(pair, **fly) -> FLyEngine:
    target, draft, tokenizer = pair
    return FLyEngine(target, tokenizer, draft, FLyConfig(**fly))


@pytest.mark.parametrize("loose", [False, True])
def test_outputs_validate_batched_with_free_rows(pair, loose):
    """Every schema's output parses and validates; free rows in the same batch stay unconstrained."""
    eng = engine(pair, loose=loose, entropy_threshold=0.0)
    rids = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for j, prompt in enumerate(PROMPTS[:2]):
            rid = f"{name}-{j}"
            eng.add_request(rid, eng.encode(prompt), SamplingParams(max_tokens=120, temperature=0.7 * j, seed=i),
                            constraint=constraint_of(eng, schema_structure(schema)))
            rids.append((rid, schema))
    eng.add_request("free", eng.encode("def add(a, b):"), SamplingParams(max_tokens=30))
    texts: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            eng.check()
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and out.request_id != "free":
                assert out.finish_reason == "stop", (out.request_id, texts[out.request_id])
    for rid, schema in rids:
        jsonschema.validate(json.loads(texts[rid]), schema)
    assert not texts["free"].startswith("{")  # the free row was not constrained


@pytest.mark.parametrize("k", [1, 4, 15])
@pytest.mark.parametrize("ngram", [False, True])
def test_exact_mode_equals_hf_generate_under_grammar(pair, k, ngram):
    target, _, tokenizer = pair
    eng = engine(pair, loose=False, k=k, ngram=ngram, adaptive=False)
    eos = sorted(eng._eos)
    cases = [(p, schema_structure(s)) for p, s in zip(PROMPTS, SCHEMAS.values())]
    cases.append(("def add", Structure(response_format={"type": "regex", "pattern": r"[a-c]{2,9}!"})))
    prompts = [eng.encode(p) for p, _ in cases]
    for i, (ids, (_, structure)) in enumerate(zip(prompts, cases)):
        eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=40), constraint=constraint_of(eng, structure))
    eng.add_request("free", eng.encode("The dog"), SamplingParams(max_tokens=20))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        eng.check()
    for i, (ids, (_, structure)) in enumerate(zip(prompts, cases)):
        grammar = grammar_of(constraint_of(eng, structure))
        assert got[f"r{i}"] == constrained_greedy(target, tokenizer, ids, grammar, 40, eos), i


def test_forced_tokens_are_drafted_and_counted(pair):
    """A schema with long constant keys: the keys and separators are forced, free and kept."""
    schema = {"type": "object", "properties": {"the_first_long_key": {"type": "boolean"},
                                               "another_long_key_here": {"type": "boolean"}},
              "required": ["the_first_long_key", "another_long_key_here"], "additionalProperties": False}
    eng = engine(pair, loose=False, draft_model=False, ngram=False)
    [gen] = eng.generate("x", SamplingParams(max_tokens=60), constraint=constraint_of(eng, schema_structure(schema)))
    assert gen.finish_reason == "stop"
    jsonschema.validate(json.loads(gen.text), schema)
    assert gen.stats.forced >= 10, gen.stats
    assert gen.stats.grammar_s > 0  # compiled (and timed) at admission
    [again] = eng.generate("y", SamplingParams(max_tokens=60), constraint=constraint_of(eng, schema_structure(schema)))
    assert again.stats.grammar_s == 0  # the compiled grammar came from the cache
    assert gen.stats.rounds < gen.completion_tokens / 2  # forced runs make rounds emit many tokens


def test_required_and_named_tool_choice_yield_valid_calls(pair):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "lookup", "parameters": {
            "type": "object", "properties": {"key": {"enum": ["fox", "dog"]}}, "required": ["key"],
            "additionalProperties": False}}}]
    eng = engine(pair)
    for choice in ["required", {"type": "function", "function": {"name": "lookup"}}]:
        structure = Structure(tools=tools, tool_choice=choice)
        for prompt in PROMPTS:
            [gen] = eng.generate(prompt, SamplingParams(max_tokens=80), constraint=constraint_of(eng, structure))
            content, calls = split_tool_calls(gen.text)
            assert calls and not content, gen.text
            for call in calls:
                spec = next(t["function"] for t in tools if t["function"]["name"] == call.name)
                jsonschema.validate(call.arguments, spec["parameters"])
                if choice != "required":
                    assert call.name == "lookup"


def test_tool_choice_none_never_starts_a_call(pair):
    tools = [{"type": "function", "function": {"name": "add"}}]
    eng = engine(pair)
    structure = Structure(tools=tools, tool_choice="none")
    for prompt in PROMPTS:
        [gen] = eng.generate(prompt, SamplingParams(max_tokens=40), constraint=constraint_of(eng, structure))
        assert "<tool_call>" not in gen.text


@pytest.mark.parametrize("response_format, problem", [
    ({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}, "frobnicate"),
    ({"type": "regex", "pattern": "[a-"}, "regex"),
])
def test_bad_grammars_are_bad_requests(pair, response_format, problem):
    eng = engine(pair)
    with pytest.raises(BadRequest) as err:
        eng.add_request("bad", eng.encode("x"), SamplingParams(),
                        constraint=constraint_of(eng, Structure(response_format=response_format)))
    assert not eng.has_unfinished()
    assert problem in str(err.value).lower() or "grammar" in str(err.value).lower()


def test_valid_prefix_helper_rejects_garbage(pair):
    """The test oracle itself can fail: a token sequence outside the grammar is not accepted."""
    _, _, tokenizer = pair
    eng = engine(pair)
    grammar = grammar_of(constraint_of(eng, schema_structure(SCHEMAS["enum_bool"])))
    bad = tokenizer.encode('{"color": "purple"}')
    assert grammar_valid_prefix(tokenizer, eng.vocab_size, sorted(eng._eos), grammar, bad) < len(bad)


def test_tool_tags_that_are_special_tokens_are_named_as_tokens():
    """Qwen2.5's <tool_call> is one special token: the grammars must name it as a token, not as text."""
    from fly_llm.decoding.grammar import GrammarCompiler
    from support.tiny_models import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    open_id, close_id = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    constraints = Constraints(HERMES, compiler.special_tokens)
    assert compiler.special_tokens(HERMES.tags) == {"<tool_call>", "</tool_call>"}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}}}]
    call = [open_id, *tokenizer.encode('\n{"name": "f", "arguments": {"x": 2}}\n'), close_id]
    text = tokenizer.encode("The dog sleeps.")
    eos = [tokenizer.eos_token_id]

    def accepts(choice, tokens) -> bool:
        matcher = compiler.for_constraint(constraints.constraint(Structure(tools=tools, tool_choice=choice)))
        return matcher.validate_tokens(tokens) == len(tokens)

    assert accepts("auto", text + call + text + eos) and accepts("auto", text + eos)
    bare = tokenizer.encode('{"name": "f", "arguments": {"x": 1}}\n{"name": "f", "arguments": {"x": 2}}')
    assert accepts("auto", bare + eos)  # bare call objects (small models answer so) are constrained too
    assert not accepts("auto", tokenizer.encode('{"name": "f", "arguments": {"x": 3}}') + eos)
    assert accepts("required", call + eos) and not accepts("required", text + call + eos)
    assert accepts("none", text + eos) and not accepts("none", text + call + eos)
    forced = compiler.for_constraint(constraints.constraint(Structure(tools=tools, tool_choice="required")))
    forced = forced.compute_ff_tokens()
    assert forced[0] == open_id


@pytest.mark.parametrize("special", [False, True])
def test_parallel_tool_calls_false_allows_at_most_one_call(special):
    """OpenAI's parallel_tool_calls=False: the grammar ends the answer's calls after the first, with
    the tool-call tags as text or (Qwen2.5) as special tokens; a single call stays valid."""
    from fly_llm.decoding.grammar import GrammarCompiler
    from support.tiny_models import make_tokenizer

    tokenizer = make_tokenizer()
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    constraints = Constraints(HERMES, compiler.special_tokens)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}}}]

    def call(x: int) -> list[int]:
        body = tokenizer.encode(f'\n{{"name": "f", "arguments": {{"x": {x}}}}}\n')
        if special:
            return [tokenizer.convert_tokens_to_ids("<tool_call>"), *body, tokenizer.convert_tokens_to_ids("</tool_call>")]
        return tokenizer.encode("<tool_call>") + body + tokenizer.encode("</tool_call>")

    text, newline, eos = tokenizer.encode("The dog sleeps."), tokenizer.encode("\n"), [tokenizer.eos_token_id]
    bare = [tokenizer.encode('{"name": "f", "arguments": {"x": 1}}'), tokenizer.encode('{"name": "f", "arguments": {"x": 2}}')]
    answers = {  # choice -> (one call, two calls)
        "auto": (text + call(1) + text + eos, text + call(1) + text + call(2) + text + eos),
        "required": (call(1) + eos, call(1) + newline + call(2) + eos),
    }

    def accepts(choice, parallel, tokens) -> bool:
        structure = Structure(tools=tools, tool_choice=choice, parallel_tool_calls=parallel)
        return compiler.for_constraint(constraints.constraint(structure)).validate_tokens(tokens) == len(tokens)

    for choice, (one, two) in answers.items():
        for parallel in (None, True, False):
            assert accepts(choice, parallel, one), (choice, parallel)
            assert accepts(choice, parallel, two) == (parallel is not False), (choice, parallel)
    assert accepts("auto", False, bare[0] + eos) and accepts("auto", False, text + eos)
    assert accepts("auto", None, bare[0] + newline + bare[1] + eos)
    assert not accepts("auto", False, bare[0] + newline + bare[1] + eos)
