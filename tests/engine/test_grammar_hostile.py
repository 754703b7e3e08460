"""Untrusted grammars (issue 33 findings 1, 4, 5): caps, the sacrificial compiler, empty languages,
grammars that fail mid-output, `$defs` in tool parameters, compiling off the model thread.

A grammar that crashes llguidance is only ever compiled in a subprocess here (the sandbox's
worker, or a child Python for the end-to-end check): a crash is a failing test, not a dead run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from benchmarks.engine.grammar_compile_bench import agent_tools

import fly_llm
from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding import grammar_sandbox
from fly_llm.decoding.grammar_sandbox import GrammarSandbox, public_message
from fly_llm.common.schema_limits import UNIMPLEMENTED, SchemaCaps, check_schema, hoist_defs, loosened
from fly_llm.common.errors import BadRequest
from fly_llm.common.tool_formats import Constraints
from fly_llm.common.tool_formats.hermes import split_tool_calls
from fly_llm.common.tools import Structure
from support.nested_models import Person
from support.structures import constraint_of, schema_structure
from support.tiny_models import make_pair, make_tokenizer

torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama")


def engine(pair, **kwargs) -> FLyEngine:
    target, draft, tokenizer = pair
    return FLyEngine(target, tokenizer, draft, FLyConfig(loose=False), **kwargs)


def ref_chain(n: int) -> dict:
    """`$defs` d0 → d1 → … → dn, each only a `$ref` to the next (llguidance 1.9.1 overflows its stack
    on this past ~2,200 links on an 8 MiB stack; ~950 when each link is an object property)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def run(eng: FLyEngine, requests: dict[str, Structure | None], max_tokens: int = 40) -> dict:
    """Add each request (prompt "x"), step to the end checking invariants; {id: (text, last output)}."""
    for rid, structure in requests.items():
        eng.add_request(rid, eng.encode("x"), SamplingParams(max_tokens=max_tokens),
                        constraint=constraint_of(eng, structure))
    texts, last = {rid: "" for rid in requests}, {}
    while eng.has_unfinished():
        for out in eng.step():
            texts[out.request_id] += out.new_text
            last[out.request_id] = out
        eng.check()
    return {rid: (texts[rid], last[rid]) for rid in requests}


# -- finding 1: a long $ref chain ----------------------------------------------------------------------

def test_a_long_ref_chain_is_a_bad_request_not_a_dead_process():
    """The issue's reproduction, in a child process: on the old code it dies of SIGSEGV."""
    code = textwrap.dedent("""
        import json, sys
        from support.tiny_models import make_pair
        from fly_llm.decoding.engine import FLyEngine
        from fly_llm.common.config import SamplingParams
        from fly_llm.common.errors import BadRequest
        from support.structures import constraint_of, schema_structure
        target, draft, tokenizer = make_pair("llama")
        eng = FLyEngine(target, tokenizer, draft)
        schema = json.loads(sys.argv[1])
        try:
            eng.add_request("r", eng.encode("x"), SamplingParams(),
                            constraint=constraint_of(eng, schema_structure(schema)))
        except BadRequest as exc:
            print("BAD_REQUEST", exc.message)
    """)
    path = os.pathsep.join([str(TESTS), str(Path(fly_llm.__file__).resolve().parents[1])])  # this fly_llm
    done = subprocess.run([sys.executable, "-c", code, json.dumps(ref_chain(3000))], capture_output=True, text=True,
                          timeout=300, cwd=TESTS, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "BAD_REQUEST" in done.stdout and "too large for this server" in done.stdout, done.stdout


@pytest.fixture(scope="module")
def setup():
    from fly_llm.decoding.grammar_sandbox import tokenizer_setup

    tokenizer = make_tokenizer()
    return tokenizer_setup(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def json_grammar(schema: dict) -> str:
    return "start: %json " + json.dumps(schema) + "\n"


def test_the_sandbox_names_a_crash_and_keeps_serving(setup):
    """Past the caps (called directly): the worker dies, the grammar is tried once more in a fresh worker
    (a death by a signal may be the worker's own), which dies too; the verdict names the crash, the next
    grammar gets a new worker, and the crash is remembered without another one."""
    sandbox = GrammarSandbox(setup)
    try:
        with pytest.raises(BadRequest, match="crashed on this grammar"):
            sandbox.check(json_grammar(ref_chain(3000)))
        assert (sandbox.starts, sandbox.retries) == (2, 1)
        sandbox.check(json_grammar(ref_chain(10)))
        assert sandbox.starts == 3
        start = time.perf_counter()
        with pytest.raises(BadRequest, match="crashed"):
            sandbox.check(json_grammar(ref_chain(3000)))
        assert time.perf_counter() - start < 0.05 and sandbox.starts == 3
    finally:
        sandbox.close()


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_a_worker_stopped_or_killed_mid_request_is_no_verdict(setup, monkeypatch, sig):
    """Issue 45 finding 5: a worker stopped (SIGSTOP: it never answers) or killed (an OOM killer) while a
    valid grammar was sent to it made that grammar's timeout or crash the cached verdict, refused forever.
    Now the worker is replaced and the grammar tried again: accepted, and that is what is remembered."""
    sandbox = GrammarSandbox(setup, timeout_s=2.0)
    stopped: list[int] = []

    def send(process, message):
        if "grammar" in message and not stopped:  # the first grammar's worker is hit as the grammar is sent
            stopped.append(process.pid)
            os.kill(process.pid, sig)
        real_send(process, message)

    real_send = grammar_sandbox._send
    monkeypatch.setattr(grammar_sandbox, "_send", send)
    try:
        valid = json_grammar({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
        sandbox.check(valid)
        assert stopped and (sandbox.starts, sandbox.retries) == (2, 1)
        sandbox.check(valid)  # remembered as good: no worker asked
        assert (sandbox.starts, sandbox.retries) == (2, 1)
    finally:
        sandbox.close()


def test_a_slow_grammar_holds_one_worker_not_the_others(setup, monkeypatch):
    """Issue 45 finding 4: one worker behind a lock made every compile wait for the slowest. With two, a
    grammar whose worker hangs (SIGSTOP: it answers only at the timeout) holds that worker alone: another
    client's grammar is judged meanwhile, long before the stalled one's timeout."""
    sandbox = GrammarSandbox(setup, timeout_s=8.0, workers=2)
    stalled = threading.Event()

    def send(process, message):
        if message.get("grammar", "").startswith("start: %json {\"title\": \"slow\"") and not stalled.is_set():
            os.kill(process.pid, signal.SIGSTOP)
            stalled.set()
        real_send(process, message)

    real_send = grammar_sandbox._send
    monkeypatch.setattr(grammar_sandbox, "_send", send)
    slow = json_grammar({"title": "slow", "type": "object", "properties": {"a": {"type": "string"}}})
    quick = json_grammar({"type": "object", "properties": {"b": {"type": "integer"}}})
    try:
        sandbox.check(json_grammar({"type": "string"}))  # the first worker is up; the second starts on demand
        done: list[float] = []
        started = time.perf_counter()
        holder = threading.Thread(target=lambda: (sandbox.check(slow), done.append(time.perf_counter() - started)))
        holder.start()
        assert stalled.wait(30)
        sandbox.check(quick)
        quick_s = time.perf_counter() - started
        holder.join(60)
        assert quick_s < 8.0 and done and done[0] >= 8.0, (quick_s, done)  # the slow one: timeout, then retried
        assert sandbox.retries == 1
    finally:
        sandbox.close()


def test_the_sandbox_bounds_time_and_memory(setup):
    many = json_grammar({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}})
    big_enum = json_grammar({"enum": ["x" * 50 + str(i) for i in range(10_000)]})
    for sandbox, grammar, problem in [(GrammarSandbox(setup, timeout_s=0.005), many, "took longer than 0.005 s"),
                                      (GrammarSandbox(setup, memory_bytes=4 << 20), big_enum, "memory limit (4 MiB)")]:
        try:
            with pytest.raises(BadRequest, match=re.escape(problem)):
                sandbox.check(grammar)
            sandbox.check(json_grammar({"type": "boolean"}))  # a new worker after the old one was stopped
        finally:
            sandbox.close()


# -- caps ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schema, cap", [
    (ref_chain(200), "nesting depth"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"$ref": "#/$defs/y"}},
      "definitions": {f"y{i}": {"type": "string"} for i in range(1001)}}, "1000 $defs"),
    ({"enum": list(range(10_001))}, "enum of more than 10000"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1001)}}, "1000 properties"),
    ({"anyOf": [{"anyOf": [{"type": "string"} for _ in range(100)]} for _ in range(101)]}, "10000 subschemas"),
])
def test_each_cap_is_named(schema, cap):
    with pytest.raises(BadRequest, match="too large") as err:
        check_schema(schema)
    assert cap in err.value.message


def test_real_schemas_are_far_below_the_caps():
    """A recursive pydantic model and a 20-tool agent's tools pass with every cap tenfold lower but nodes."""
    tight = SchemaCaps(nodes=2_000, defs=100, depth=12, enum=1_000, properties=100)
    check_schema(Person.model_json_schema(), tight)
    check_schema({"anyOf": [t["function"]["parameters"] for t in agent_tools(20)]}, tight)


def test_caps_apply_to_tools_and_response_format(pair):
    eng = engine(pair)
    deep = ref_chain(500)
    for structure in (schema_structure(deep), Structure(tools=[{"type": "function", "function": {
            "name": "f", "parameters": deep}}], tool_choice="required")):
        with pytest.raises(BadRequest, match="nesting depth"):
            eng.compile_constraint(constraint_of(eng, structure))


def test_deeply_nested_data_in_a_schema_is_a_bad_request(pair):
    """`const` data is not walked as schemas; nested past what can be serialized it is still refused."""
    value: object = 1
    for _ in range(3000):
        value = [value]
    eng = engine(pair)
    for structure in (schema_structure({"const": value}), Structure(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"const": value}}}}}])):
        with pytest.raises(BadRequest):
            eng.compile_constraint(constraint_of(eng, structure))


# -- finding 5: empty languages --------------------------------------------------------------------------

@pytest.mark.parametrize("response_format", [
    {"type": "regex", "pattern": r"[^\s\S]"},
    {"type": "json_schema", "schema": {"$ref": "#"}},
    {"type": "json_schema", "schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
])
def test_an_empty_language_is_refused_at_admission(pair, response_format):
    """On the old code these were admitted and ended at once with 'stop' and no text."""
    eng = engine(pair)
    with pytest.raises(BadRequest, match="language is empty"):
        eng.add_request("r", eng.encode("x"), SamplingParams(),
                        constraint=constraint_of(eng, Structure(response_format=response_format)))
    assert not eng.has_unfinished()


DEAD_END = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
            "additionalProperties": False, "$defs": {"x": {"$ref": "#/$defs/x"}}}
"""Its language is empty, but llguidance sees it only after `{"a": ` (forced): admitted, then fails."""


def test_a_grammar_that_fails_mid_output_ends_only_its_request_with_an_error(pair):
    good = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    eng = engine(pair)
    results = run(eng, {"dead": schema_structure(DEAD_END), "good": schema_structure(good), "free": None})
    text, out = results["dead"]
    assert out.finished and out.error and "no continuation" in out.error, (text, out)
    for rid in ("good", "free"):
        assert results[rid][1].error is None and results[rid][1].finished
    jsonschema.validate(json.loads(results["good"][0]), good)
    with pytest.raises(BadRequest, match="no continuation"):
        eng.generate("x", SamplingParams(max_tokens=40), constraint=constraint_of(eng, schema_structure(DEAD_END)))
    assert not eng.has_unfinished()


# -- finding 4: $defs / $ref in tool parameters -------------------------------------------------------------

def check_call(eng: FLyEngine, tools: list[dict], name: str) -> None:
    """Force a call of `name`; its arguments validate against the tool's original parameters."""
    structure = Structure(tools=tools, tool_choice={"type": "function", "function": {"name": name}})
    [gen] = eng.generate("x", SamplingParams(max_tokens=200), constraint=constraint_of(eng, structure))
    _, calls = split_tool_calls(gen.text)
    assert gen.finish_reason == "stop" and [c.name for c in calls] == [name], gen.text
    spec = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    jsonschema.validate(calls[0].arguments, spec)


def test_pydantic_nested_models_as_tool_parameters(pair):
    """openai.pydantic_function_tool's schema ($defs, recursion): refused with 'Pointer … does not exist'
    on the old code."""
    tools = [openai.pydantic_function_tool(Person, name="save"),
             {"type": "function", "function": {"name": "other", "parameters": {
                 "$defs": {"Person": {"type": "object", "properties": {"id": {"enum": [1, 2]}}, "required": ["id"],
                                      "additionalProperties": False}},
                 "type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"],
                 "additionalProperties": False}}}]
    eng = engine(pair)
    check_call(eng, tools, "save")
    check_call(eng, tools, "other")  # its own Person, not save's


def test_root_recursion_and_definitions_in_tool_parameters(pair):
    tree = {"type": "object", "properties": {"v": {"enum": [1, 2]}, "kids": {"type": "array", "items": {"$ref": "#"},
                                                                              "maxItems": 1}},
            "required": ["v", "kids"], "additionalProperties": False}
    legacy = {"type": "object", "definitions": {"Leaf": {"enum": ["a", "b"]}},
              "properties": {"leaf": {"$ref": "#/definitions/Leaf"}, "same": {"$ref": "#/properties/leaf"}},
              "required": ["leaf", "same"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}},
             {"type": "function", "function": {"name": "legacy", "parameters": legacy}}]
    eng = engine(pair)
    check_call(eng, tools, "tree")
    check_call(eng, tools, "legacy")


def test_hoisting_leaves_schemas_without_refs_alone_and_data_untouched():
    plain = {"type": "object", "properties": {"a": {"const": {"$ref": "#/x"}}}}
    assert hoist_defs(plain, "t") == (plain, {})
    body, hoisted = hoist_defs({"$defs": {"A": {"default": {"$ref": "#"}}}, "$ref": "#/$defs/A"}, "t")
    assert body == {"$ref": "#/$defs/t:A"} and hoisted == {"t:A": {"default": {"$ref": "#"}}}


# -- compiling off the model thread, caching -------------------------------------------------------------------

def test_a_repeated_tool_list_costs_nothing_the_second_time(pair):
    eng = engine(pair)
    constraints = Constraints.of(eng)
    eng.compile_constraint(constraints.constraint(Structure(tools=agent_tools(20), tool_choice="auto")))
    again = Structure(tools=agent_tools(20), tool_choice="auto")  # a new request with the same tools
    compiled_s, starts = eng.grammars.compile_s, eng.grammars.sandbox.starts
    start = time.perf_counter()
    matcher = eng.compile_constraint(constraints.constraint(again))
    assert time.perf_counter() - start < 0.05 and matcher is not None  # ~0.1 ms here
    assert (eng.grammars.compile_s, eng.grammars.sandbox.starts) == (compiled_s, starts)


def test_grammar_caches_are_scoped_per_tenant(pair, monkeypatch):
    """Issue 45 finding 6: one grammar cache for all let a tenant tell by timing that another had sent a
    schema. Each scope (tenant) now compiles, and is judged by the sandbox, on its own; within a scope a
    repeat is a copy."""
    eng = engine(pair)
    sandboxed, compiled = [], []
    real_check, real_compile = GrammarSandbox.check, type(eng.grammars)._compile
    monkeypatch.setattr(GrammarSandbox, "check", lambda self, grammar, scope="": (
        sandboxed.append(scope), real_check(self, grammar, scope))[1])
    monkeypatch.setattr(type(eng.grammars), "_compile", lambda self, grammar, scope: (
        compiled.append(scope), real_compile(self, grammar, scope))[1])
    constraint = constraint_of(eng, schema_structure({"type": "object", "properties": {"q": {"type": "string"}}}))
    for scope in ["tenant-a", "tenant-a", "tenant-b", "tenant-a", "tenant-b"]:
        assert eng.compile_constraint(constraint, scope) is not None
    assert compiled == sandboxed == ["tenant-a", "tenant-b"]
    assert eng.compiled_matcher(constraint, "tenant-a") is not None  # a hit is a copy: nothing compiles
    assert eng.compiled_matcher(constraint, "tenant-c") is None  # what another tenant compiled is not its
    assert compiled == ["tenant-a", "tenant-b"]
    verdicts = len(eng.grammars.sandbox._verdicts)
    eng.grammars.sandbox.check(eng.grammars.grammar(constraint, "tenant-c"), "tenant-c")
    assert len(eng.grammars.sandbox._verdicts) == verdicts + 1  # its own verdict, not tenant-a's


def test_compiling_on_another_thread_while_the_model_thread_steps(pair):
    """compile_constraint from a worker thread, add_request(matcher=) on the model thread; the batch's
    constrained rows stay valid and the engine's invariants hold after every step."""
    eng = engine(pair)
    schemas = [{"type": "object", "properties": {f"k{i}": {"enum": [i, i + 1]}}, "required": [f"k{i}"],
                "additionalProperties": False} for i in range(6)]
    compiled: list = []
    worker = threading.Thread(target=lambda: compiled.extend(
        eng.compile_constraint(constraint_of(eng, schema_structure(s))) for s in schemas))
    worker.start()
    eng.add_request("first", eng.encode("x"), SamplingParams(max_tokens=30),
                    constraint=constraint_of(eng, schema_structure(schemas[0])))
    texts: dict[str, str] = {}
    while eng.has_unfinished() or worker.is_alive():
        for out in eng.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            assert out.error is None
        eng.check()
        while len(compiled) > sum(rid.startswith("w") for rid in texts) and len(texts) <= len(schemas):
            i = sum(rid.startswith("w") for rid in texts)
            eng.add_request(f"w{i}", eng.encode("x"), SamplingParams(max_tokens=30), matcher=compiled[i])
            texts[f"w{i}"] = ""
    worker.join()
    for i, schema in enumerate(schemas):
        jsonschema.validate(json.loads(texts[f"w{i}"]), schema)


# -- prefix-cache scope and whole-block cached_tokens --------------------------------------------------------------

def test_cached_tokens_count_whole_blocks_and_scopes_do_not_share(pair):
    eng = engine(pair, prefix_cache_bytes=1 << 20, prefix_block=4)
    prompt = eng.encode("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.")
    assert (len(prompt) - 1) % 4, "the test needs a prompt whose full hit ends mid-block"

    def cached(scope: str) -> int:
        eng.add_request(scope + str(time.monotonic()), prompt, SamplingParams(max_tokens=2), cache_scope=scope)
        outs = [out for _ in range(50) if eng.has_unfinished() for out in eng.step()]
        return outs[-1].cached_tokens

    assert cached("alice") == 0
    assert cached("bob") == 0  # alice's prompt is not bob's hit
    assert cached("alice") == (len(prompt) - 1) // 4 * 4 > 0  # whole blocks, though all but one token are reused


@pytest.mark.parametrize("raw,public", [
    ("panicked at /home/runner/.cargo/registry/src/index.crates.io/llguidance-1.9/src/earley/parser.rs:812:9:\n"
     "index out of bounds", "an internal error of the grammar engine"),
    ("panic: attempt to subtract with overflow", "an internal error of the grammar engine"),
    ("called `Option::unwrap()` on a `None` value at parser/src/api.rs:40:7", "an internal error of the grammar engine"),
    ("unknown name: 'item'\n  --> line 3\n  item*", "unknown name: 'item'"),
])
def test_grammar_engine_errors_reach_clients_as_one_line_without_paths(raw, public):
    """Issue 45 finding 6: llguidance panic messages (with build paths) were returned to clients."""
    assert public_message(raw) == public


def test_loosening_drops_only_the_unimplemented_keywords_at_any_depth():
    deep = {"type": "object", "properties": {"a": {"anyOf": [{"type": "array", "items": {"type": "string"},
                                                              "uniqueItems": True, "contains": {"const": "x"}}]}},
            "$defs": {"D": {"type": "object", "propertyNames": {"maxLength": 3}, "not": {"required": ["z"]}}},
            "if": {"required": ["a"]}, "then": {"required": ["b"]}, "else": {}, "enum": [{"not": 1}]}
    loose = loosened(deep)
    assert loose == {"type": "object", "properties": {"a": {"anyOf": [{"type": "array", "items": {"type": "string"}}]}},
                     "$defs": {"D": {"type": "object"}}, "enum": [{"not": 1}]}  # enum values are data, untouched
    assert "uniqueItems" in deep["properties"]["a"]["anyOf"][0]  # a copy: the request's schema is unchanged
    plain = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]}
    assert loosened(plain) == plain and set(UNIMPLEMENTED) >= {"propertyNames", "uniqueItems", "not", "if"}
