"""Hypothesis strategies of hostile request content (issue 33), for both doors of the daemon.

`FAMILIES` draws `Case`s, each a door-neutral generate request (prompt or chat messages, sampling, FLy
options, tools, tool_choice, response_format) or raw bytes, from a weighted mix of families — random
JSON schemas (deep, wide, recursive, dangling and chained `$ref`s, huge enums, odd formats and
patterns), regexes, tool lists, message lists (odd unicode, lone surrogates, tool-call arguments as
deep JSON text, tool results for unknown calls), options at their edges, and malformed frames.
`CI_EXAMPLES` says how many of each a CI run tries. `OPENAI_FAMILIES` are the OpenAI door's alone (issue
36's routes and fields): /tokenize and /detokenize bodies (odd text, bad, huge and mistyped ids), `n`
(0, 17, huge, mistyped, streamed), `logprobs` / `top_logprobs` (out of range, mistyped, with `echo` on
/v1/completions), the embedding routes' bodies (/v1/embeddings, /api/embed, /api/embeddings: texts
over the model's length, ids out of the vocabulary, too many inputs, odd formats, dimensions, models), and
issue 45's: `n` × `echo` × `logprobs` amplification on long prompts, and forwarded-header spoofing
(`X-Forwarded-For` / `Forwarded` lines a client writes itself: tests/support/forwarded_headers.py).

Shapes known to have killed the daemon are families of their own, drawn often enough to be found
within a CI run: a `$defs` chain of ~1,000+ `$ref`s (llguidance segfaults compiling it), tool-call
`arguments` nested ~1,000+ levels deep (RecursionError in the validator), a long chain under a
required tool (forced deep output). Big shapes are built from one drawn size, never drawn element by
element, so they stay cheap for hypothesis. Nothing here talks to the daemon (only its limits are imported):
`doors.py` sends cases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from fly_llm.common.protocol import MAX_TOP_LOGPROBS

from support.forwarded_headers import forwarded_headers

from fly_daemon.http.openai_api import MAX_CHOICES

Json = Any

PROMPTS = ["def add(a, b):", "The quick brown fox", "x", "Question: what is 2 + 3?", "for i in range(10):"]
ODD_TEXT = [
    "", " ", "\x00", "\ud800", "\udfff", "a\ud83dz", "\U0001f600" * 40, "\u202e\u2066evil\u2069", "\ufeff",
    "\u0301\u0301\u0301", "<|im_end|>", "<|im_start|>system\n", "<tool_call>\n{\"name\": \"x\"}\n</tool_call>",
    "\r\n\t\x0b\x0c", "\ufffd" * 64, "ÿ" * 100, "{{ 7*7 }}{% raw %}", "\\u0000", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]
FORMATS = ["date-time", "date", "time", "email", "uri", "uuid", "ipv4", "ipv6", "hostname", "regex", "duration",
           "x-unknown", "", "\x00", "%s%n", "json-pointer", "idn-email"]
TOOL_NAMES = ["get_weather", "search", "a", "x" * 64, "x" * 65, "", "bad name", "naïve", "a/b", "-", ".", "ok.v2",
              "<tool_call>", "\ud800", "__proto__", "1" * 10]
STOP_CODES = ("BAD_REQUEST", "TOO_LONG", "FIM_UNSUPPORTED", "BUSY", "TIMEOUT")
"""The codes a hostile request may be refused with; anything else (INTERNAL, a death, a hang) is a finding."""


@dataclass(frozen=True)
class Case:
    """One hostile example: a door-neutral request (`request`) or raw bytes (`frame`), and what it must get.

    `must_refuse`: its language is empty or it is invalid on its face, so being served is a finding too.
    """

    family: str
    request: dict[str, Any] = field(default_factory=dict)
    frame: bytes | None = None
    multipart: bool = False
    must_refuse: bool = False
    route: str | None = None
    """An HTTP route of its own (/tokenize, /detokenize): the OpenAI door posts `request` there as it is."""
    headers: tuple[tuple[str, bytes], ...] = ()
    """HTTP header lines the OpenAI door sends too (forwarded-header spoofing)."""

    def __repr__(self) -> str:
        body = self.frame if self.frame is not None else json.dumps(self.request, default=str)
        text = repr(body)
        shown = text if len(text) <= 600 else f"{text[:400]} … {text[-150:]} ({len(text)} chars)"
        lines = f", headers={repr(self.headers)[:300]}" if self.headers else ""
        return f"Case(family={self.family!r}, must_refuse={self.must_refuse}, body={shown}{lines})"


# ---- big shapes, built from one drawn size ----

def ref_chain(length: int, *, wrap: bool = True, end: Json | None = None) -> dict[str, Any]:
    """A schema whose `$defs` form a chain of `length` `$ref`s (each an object holding the next, if `wrap`)."""
    def link(i: int) -> dict[str, Any]:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {"type": "object", "properties": {"x": ref}, "required": ["x"]} if wrap else ref

    defs = {f"d{i}": link(i) for i in range(length)}
    defs[f"d{length}"] = end if end is not None else {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_schema(depth: int) -> dict[str, Any]:
    """An inline schema nested `depth` objects deep (no refs)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def deep_json_text(depth: int, opener: str = "[") -> str:
    """JSON text of an object holding `depth` nested arrays (or objects): `{"a": [[[…]]]}`."""
    if opener == "[":
        inner = "[" * depth + "]" * depth
    else:
        inner = '{"a": ' * depth + "1" + "}" * depth
    return '{"a": ' + inner + "}"


def huge_enum(size: int) -> dict[str, Any]:
    """A string enum of `size` distinct values."""
    return {"enum": [f"v{i}" for i in range(size)]}


def wide_object(width: int) -> dict[str, Any]:
    """An object schema with `width` required properties."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(width)},
            "required": [f"p{i}" for i in range(width)]}


# ---- schemas and regexes ----

def regexes() -> st.SearchStrategy[str]:
    """Regex patterns: plain, odd (backrefs, lookarounds, huge counts, nested repeats) and broken."""
    atom = st.sampled_from(["a", "[a-z]", ".", r"\d", r"\w+", r"\p{L}", "[^a]", "(a|b)", "[z-a]", "(", ")", r"\1",
                            "(?=a)", "(?<!b)", "^", "$", r"\b", "a{2,1}", "a{0,1000}", "(a{1,100}){1,100}",
                            "(a*)*", "[[:alpha:]]", r"\u{10FFFF}", "\ud800", "é", r"\\", "*", "a**", "a{99999}",
                            "(?P<n>a)(?P=n)", "[^\\s\\S]?", "(?i)A", "[\\x00-\\x{10FFFF}]"])
    return st.lists(atom, min_size=1, max_size=6).map("".join)


def _leaf_schemas() -> st.SearchStrategy[Json]:
    number = st.one_of(st.integers(-(10**30), 10**30), st.floats(allow_nan=False, allow_infinity=False))
    return st.one_of(
        st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null", "object", "array",
                                               "bogus")] + [True, False, {}, {"type": ["string", "null"]}]),
        st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(FORMATS)),
        st.builds(lambda p: {"type": "string", "pattern": p}, regexes()),
        st.builds(lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": hi},
                  st.integers(-1, 5000), st.integers(-1, 5000)),
        st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}, number, number),
        st.builds(lambda v: {"const": v}, st.one_of(st.text(max_size=8), number, st.none())),
        st.builds(lambda values: {"enum": values}, st.lists(st.one_of(st.text(max_size=6), st.integers()),
                                                            max_size=8)),
        st.sampled_from([{"$ref": "#/$defs/missing"}, {"$ref": "http://example.com/s.json"}, {"$ref": "#"},
                         {"$ref": "#/definitions/\u00e9"}, {"$ref": ""}, {"$ref": 7}, {"$dynamicRef": "#x"}]),
    )


def _extend_schema(children: st.SearchStrategy[Json]) -> st.SearchStrategy[Json]:
    names = st.one_of(st.text(st.characters(codec="utf-8"), max_size=6),
                      st.sampled_from(["\ud800", "$ref", "", "a" * 300]))
    return st.one_of(
        st.builds(lambda props, extra: {"type": "object", "properties": props,
                                        "required": list(props)[:2], **extra},
                  st.dictionaries(names, children, max_size=4),
                  st.sampled_from([{}, {"additionalProperties": False}, {"additionalProperties": True},
                                   {"minProperties": 3, "maxProperties": 1}, {"patternProperties": {"(": {}}}])),
        st.builds(lambda item, lo: {"type": "array", "items": item, "minItems": lo}, children, st.integers(-1, 64)),
        st.builds(lambda items: {"prefixItems": items, "items": False}, st.lists(children, max_size=3)),
        st.builds(lambda key, subs: {key: subs}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                  st.lists(children, max_size=3)),
        st.builds(lambda sub: {"not": sub}, children),
        st.builds(lambda a, b, c: {"if": a, "then": b, "else": c}, children, children, children),
        st.builds(lambda sub: {"$defs": {"n": sub}, "$ref": "#/$defs/n"}, children),
    )


def json_schemas() -> st.SearchStrategy[Json]:
    """Random JSON schemas, plus the big shapes: deep, wide, recursive and chained refs, huge enums."""
    small = st.recursive(_leaf_schemas(), _extend_schema, max_leaves=12)
    recursive = st.just({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                                             "next": {"$ref": "#/$defs/node"}}}},
                         "$ref": "#/$defs/node"})
    return st.one_of(
        small, small, small, recursive,
        st.integers(1, 400).map(ref_chain),
        st.integers(10, 300).map(nested_schema),
        st.integers(1, 20_000).map(huge_enum),
        st.integers(1, 3_000).map(wide_object),
    )


# ---- chat messages ----

def _arguments() -> st.SearchStrategy[Json]:
    return st.one_of(
        st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=10)), max_size=3),
        st.sampled_from(["", "{}", '{"a": 1}', "[1, 2]", "not json", "{", '"x"', "null", '{"a": NaN}', "1e99999",
                         '{"a": "\\ud800"}']),
        st.builds(deep_json_text, st.integers(2, 300), st.sampled_from(["[", "{"])),
    )


def _tool_call() -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda cid, name, args: {"id": cid, "type": "function",
                                              "function": {"name": name, "arguments": args}},
                     st.sampled_from(["c1", "c2", "", "x" * 200]), st.sampled_from(TOOL_NAMES), _arguments())


def text() -> st.SearchStrategy[str]:
    """Message or prompt text: known prompts, odd unicode (lone surrogates included) and random text."""
    return st.one_of(st.sampled_from(PROMPTS), st.sampled_from(ODD_TEXT),
                     st.text(st.characters(codec=None, categories=None), max_size=40),
                     st.lists(st.sampled_from(PROMPTS + ODD_TEXT), max_size=5).map("".join))


def plain_messages() -> st.SearchStrategy[list[dict[str, Any]]]:
    """A valid chat (an optional system turn, then a user turn) with odd text, to reach grammar and decoding."""
    return st.builds(lambda system, user: ([{"role": "system", "content": system}] if system else [])
                     + [{"role": "user", "content": user}], st.one_of(st.none(), text()), text())


def messages() -> st.SearchStrategy[list[dict[str, Any]]]:
    """Chat message lists: any roles, odd text, tool calls with odd arguments, results for unknown calls."""
    turn = st.one_of(
        st.builds(lambda role, content: {"role": role, "content": content},
                  st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", ""]), text()),
        st.builds(lambda calls: {"role": "assistant", "content": None, "tool_calls": calls},
                  st.lists(_tool_call(), min_size=1, max_size=3)),
        st.builds(lambda cid, content: {"role": "tool", "tool_call_id": cid, "content": content},
                  st.sampled_from(["c1", "unknown", "", "x" * 129]), text()),
    )
    user = st.builds(lambda content: {"role": "user", "content": content}, text())
    return st.one_of(st.lists(turn, min_size=0, max_size=6).map(lambda ms: ms + [{"role": "user", "content": "hi"}]),
                     st.builds(lambda ms, u: ms + [u], st.lists(turn, max_size=4), user))


# ---- tools ----

def tools() -> st.SearchStrategy[list[dict[str, Any]]]:
    """Tool lists: odd names, parameters from `json_schemas()` (pydantic-style `$defs` included), many tools."""
    pydantic_style = st.just({"$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}},
                                                   "required": ["name"]}},
                              "type": "object", "properties": {"person": {"$ref": "#/$defs/Person"}},
                              "required": ["person"]})
    params = st.one_of(json_schemas(), pydantic_style)
    name = st.one_of(st.sampled_from(["get_weather", "search", "lookup", "ok.v2", "save"]), st.sampled_from(TOOL_NAMES))
    tool = st.builds(lambda n, p: {"type": "function", "function": {"name": n, "parameters": p}}, name, params)
    many = st.integers(100, 200).map(lambda n: [{"type": "function", "function": {"name": f"t{i}"}}
                                                for i in range(n)])
    unique = st.lists(tool, min_size=1, max_size=4, unique_by=lambda t: t["function"]["name"])
    return st.one_of(unique, unique, st.lists(tool, min_size=2, max_size=3), many)


def tool_choices(names: list[str]) -> st.SearchStrategy[Json]:
    """tool_choice values: the words, a named offered or unknown tool, and junk."""
    named = [{"type": "function", "function": {"name": n}} for n in names[:2] + ["unknown"]]
    return st.sampled_from([None, "auto", "none", "required", "any", True, 7, {"type": "function"}, *named])


# ---- options at their edges ----

def sampling() -> st.SearchStrategy[dict[str, Any]]:
    """Sampling options: mostly small and valid, some at or past their limits."""
    edges = st.fixed_dictionaries({}, optional={
        "max_tokens": st.sampled_from([0, 1, 2, 500, 511, 512, 513, 4096, 4097, 100_000, 10**12, -1, "8", None]),
        "temperature": st.sampled_from([0.0, 1e-30, 0.7, 10.0, 10.0001, -0.0, -1.0, 1e308,  # float32's edges (issue 45):
                                        5e-324, 1e-40, 1.2e-38, "nan", "inf", "-inf", "1e-45"]),
        "top_p": st.sampled_from([0.0, 1e-300, 0.5, 1.0, 1.0000001, 5e-324, 1e-46, "nan", "1e-45"]),
        "top_k": st.sampled_from([0, 1, 3, 10**6, 10**6 + 1, -1, 2**63, 2.5, "nan"]),  # the samplers of issue 47
        "min_p": st.sampled_from([0.0, 1e-45, 0.5, 1.0, 1.0000001, -1e-300, "nan"]),
        "repetition_penalty": st.sampled_from([1e-300, 0.5, 1.0, 10.0, 10.01, 0.0, "inf"]),
        "presence_penalty": st.sampled_from([-2.0, 2.0, 2.0001, 5e-324, "nan"]),
        "frequency_penalty": st.sampled_from([-2.0, -2.0001, 1e-40, 2.0, "-inf"]),
        "repeat_last_n": st.sampled_from([-1, -2, 0, 1, 10**6, 10**6 + 1]),
        "seed": st.sampled_from([0, 2**63 - 1, 2**63, -1, 10**40]),
        "stop": st.one_of(st.lists(text(), max_size=4), st.lists(st.just("a"), min_size=50, max_size=60),
                          st.just(["x" * 5000])),
        "bogus": st.just(1),
    })
    plain = st.builds(lambda n: {"max_tokens": n}, st.integers(1, 12))
    return st.one_of(plain, st.builds(lambda n, extra: {"max_tokens": n, **extra}, st.integers(1, 12), edges))


def fly_options() -> st.SearchStrategy[dict[str, Any]]:
    """FLy overrides at and past their limits (unknown keys included)."""
    return st.fixed_dictionaries({}, optional={
        "k": st.sampled_from([0, 1, 64, 65, -1]), "window": st.sampled_from([0, 64, 65, -1]),
        "entropy_threshold": st.sampled_from([0.0, 20.0, 20.1, -1.0, 1e-300]),
        "loose": st.booleans(), "ngram": st.booleans(), "max_ngram": st.sampled_from([1, 16, 17]),
        "ngram_tokens": st.sampled_from([1, 64, 65]), "draft_model": st.booleans(),
        "adaptive": st.booleans(), "entropy_measure": st.sampled_from(["topk", "full", "x"]),
        "entropy_top_k": st.sampled_from([1, 1000, 1001]), "nonsense": st.just(True),
    })


# ---- families ----

def _request(**fields: Any) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not None}


@st.composite
def _schema_case(draw: st.DrawFn) -> Case:
    response_format = draw(st.one_of(
        st.builds(lambda s: {"type": "json_schema", "schema": s}, json_schemas()),
        st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, json_schemas()),
        st.builds(lambda p: {"type": "regex", "pattern": p}, regexes()),
        st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "xml"}, {"type": "regex", "pattern": ""},
                         {"type": "json_schema", "schema": []}, {"type": "json_schema", "json_schema": "x"}]),
    ))
    source = draw(st.sampled_from(["prompt", "messages"]))
    body = {"prompt": draw(st.sampled_from(PROMPTS))} if source == "prompt" else {"messages": draw(plain_messages())}
    return Case("schema", _request(**body, sampling=draw(sampling()), response_format=response_format,
                                   stream=draw(st.booleans())))


@st.composite
def _tools_case(draw: st.DrawFn) -> Case:
    offered = draw(tools())
    names = [t["function"]["name"] for t in offered]
    chat = draw(st.one_of(plain_messages(), plain_messages(), messages()))
    return Case("tools", _request(messages=chat, tools=offered, tool_choice=draw(tool_choices(names)),
                                  parallel_tool_calls=draw(st.sampled_from([None, True, False])),
                                  sampling=draw(sampling()), stream=draw(st.booleans())))


@st.composite
def _messages_case(draw: st.DrawFn) -> Case:
    return Case("messages", _request(messages=draw(messages()), sampling=draw(sampling()), fly=draw(fly_options()),
                                     stream=draw(st.booleans())))


@st.composite
def _params_case(draw: st.DrawFn) -> Case:
    timeout = draw(st.sampled_from([None, None, 1e-9, 0, 86_400, 86_401, -1]))
    return Case("params", _request(prompt=draw(text()), sampling=draw(sampling()), fly=draw(fly_options()),
                                   stream=draw(st.booleans()), timeout_s=timeout))


def _ref_chain_case(length: int) -> Case:
    """Known killer 1: a long `$ref` chain as response_format."""
    return Case("ref_chain", {"prompt": "x", "sampling": {"max_tokens": 4},
                              "response_format": {"type": "json_schema", "schema": ref_chain(length)}})


def _deep_arguments_case(depth: int) -> Case:
    """Known killer 2: a tool call whose `arguments` text nests `depth` levels."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_json_text(depth)}}
    return Case("deep_arguments", {"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": None, "tool_calls": [call]},
                                                {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
                                   "sampling": {"max_tokens": 4}})


def _forced_deep_case(length: int) -> Case:
    """Known killer 3: a required tool whose parameters hold a long chain, so the grammar forces deep output."""
    tool = {"type": "function", "function": {"name": "f", "parameters": ref_chain(length)}}
    return Case("forced_deep", {"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                                "tool_choice": "required", "sampling": {"max_tokens": 400}})


EMPTY_LANGUAGES = [
    {"type": "regex", "pattern": "[^\\s\\S]"}, {"type": "regex", "pattern": "a[^\\s\\S]+"},
    {"type": "json_schema", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
    {"type": "json_schema", "schema": {"not": {}}}, {"type": "json_schema", "schema": False},
    {"type": "json_schema", "schema": {"type": "object", "properties": {"a": False}, "required": ["a"]}},
    {"type": "json_schema", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
]
"""Response formats no text satisfies: the request must be refused, never end in a silent `stop`."""


def _empty_language_case(fmt: dict[str, Any]) -> Case:
    return Case("empty_language", {"prompt": "x", "sampling": {"max_tokens": 4}, "response_format": fmt},
                must_refuse=True)


def _frames() -> st.SearchStrategy[Case]:
    """Malformed or odd frames / bodies, as raw bytes (tokenize requests of hostile chats and tools among them)."""
    good = {"v": 1, "id": "raw", "kind": "generate", "prompt": "x", "sampling": {"max_tokens": 2}}

    def with_prompt(escaped: str) -> bytes:
        return json.dumps(good).replace('"prompt": "x"', f'"prompt": "{escaped}"').encode()

    fixed = [b"", b"null", b"[]", b"{}", b"\xff\xfe\x00", b"\xef\xbb\xbf" + json.dumps(good).encode(),
             json.dumps(good).encode()[:-3], with_prompt("\\ud800"), with_prompt("\\udfff\\ud800"),
             with_prompt("\\u0000"), json.dumps({**good, "sampling": {"max_tokens": 2, "temperature": float("nan")}})
             .encode(), b'{"v": 1, "id": "raw", "id": "raw2", "kind": "generate", "prompt": "x"}',
             b'{"v": 1e400, "id": "raw", "kind": "generate", "prompt": "x"}',
             json.dumps({"v": 1, "id": "raw", "kind": "tokenize", "text": "\ud800"}).encode(),
             json.dumps({"v": 1, "id": "raw", "kind": "heartbeat", "ids": ["a"] * 4096}).encode(),
             json.dumps({"v": 1, "id": "raw", "kind": "cancel"}).encode()]
    tokenize = st.builds(lambda ms, ts: json.dumps({"v": 1, "id": "raw", "kind": "tokenize", "messages": ms,
                                                   "tools": ts}).encode(), messages(), st.one_of(st.none(), tools()))
    deep = st.builds(lambda n, o: (o * n).encode(), st.integers(100, 50_000), st.sampled_from(["[", '{"a":']))
    deep_closed = st.integers(100, 5_000).map(lambda n: ("[" * n + "]" * n).encode())
    return st.one_of(
        st.sampled_from(fixed).map(lambda f: Case("frame", frame=f)),
        st.binary(max_size=64).map(lambda f: Case("frame", frame=f)),
        st.one_of(deep, deep_closed, tokenize).map(lambda f: Case("frame", frame=f)),
        st.just(Case("frame", frame=json.dumps(good).encode(), multipart=True)),
    )


# ---- the OpenAI door's own: issue 36's routes and fields ----

MISTYPED = [None, "2", 2.5, True, [2], {"n": 2}]
"""Values of the wrong type for an integer or boolean field (some of which pydantic coerces)."""


def _tokenize_case() -> st.SearchStrategy[Case]:
    """POST /tokenize bodies: odd text (long, too), `add_special` of any type, missing or mistyped fields."""
    good = st.builds(lambda content, special: _request(content=content, add_special=special),
                     text(), st.sampled_from([None, True, False, *MISTYPED]))
    long = st.integers(1_000, 400_000).map(lambda n: {"content": "ab " * n})
    bad = st.sampled_from([{}, {"content": None}, {"content": 7}, {"content": ["x"]}, {"text": "x"},
                           {"content": "x", "bogus": 1}, {"content": "x", "tokens": [1]}])
    return st.one_of(good, good, long, bad).map(lambda body: Case("tokenize", body, route="/tokenize"))


def _detokenize_case() -> st.SearchStrategy[Case]:
    """POST /detokenize bodies: ids in and far out of the vocabulary, huge lists, ids of the wrong type."""
    token = st.one_of(st.integers(0, 400), st.sampled_from([-1, -(2**31), 2**31, 2**63, 2**64, 10**40]))
    ids = st.builds(lambda tokens: {"tokens": tokens}, st.lists(token, max_size=24))
    known = st.builds(lambda tokens: {"tokens": tokens}, st.lists(st.integers(0, 300), max_size=64))
    huge = st.builds(lambda n, t: {"tokens": [t] * n}, st.integers(1_000, 1_500_000), st.sampled_from([1, 5, 999]))
    bad = st.sampled_from([{}, {"tokens": None}, {"tokens": "1 2"}, {"tokens": [1.5]}, {"tokens": ["1"]},
                           {"tokens": [True]}, {"tokens": [[1]]}, {"tokens": {"0": 1}}, {"tokens": [None]},
                           {"tokens": [1], "content": "x"}, {"tokens": [1.0, 2.0]}])
    return st.one_of(known, ids, huge, bad).map(lambda body: Case("detokenize", body, route="/detokenize"))


def _infill_case() -> st.SearchStrategy[Case]:
    """Fill-in-the-middle: POST /infill bodies (odd text, other files, n_predict at its edges, samplers on and
    off, mistyped and unknown fields; whole answers), `suffix` on /v1/completions, and llama.cpp's /completion
    (odd prompts, n_predict at its edges, response_fields, /infill's fields). The fuzzed daemon's
    tiny pair has no FIM tokens, so a valid one is refused FIM_UNSUPPORTED; everything else before that."""
    files = st.lists(st.fixed_dictionaries({"filename": text(), "text": text()}), max_size=3)
    infill = st.builds(lambda prefix, suffix, extra, n, top_k: _request(input_prefix=prefix, input_suffix=suffix,
                                                                        input_extra=extra, n_predict=n, top_k=top_k),
                       text(), text(), st.one_of(files, st.sampled_from([[{"filename": "f"}], [{"text": 1}], "x"])),
                       st.sampled_from([None, -1, 0, 1, 8, -2, 10**9, *MISTYPED]), st.sampled_from([None, 0, 40]))
    bad = st.sampled_from([{}, {"input_prefix": None}, {"input_prefix": 7}, {"input_sufix": "x"},
                           {"input_extra": [{"text": "t"}] * 65}, {"input_prefix": "ab " * 400_000}])
    completions = st.builds(lambda prompt, suffix: {"prompt": prompt, "suffix": suffix, "sampling": {"max_tokens": 4}},
                            st.sampled_from(PROMPTS), st.one_of(text(), st.sampled_from([None, 7, ["x"]])))
    fields = st.sampled_from([None, ["content"], ["content", "timings/prompt_n", "nothing/here"], ["content", ""]])
    llama = st.builds(lambda prompt, n, kept, extra: {**_request(prompt=prompt, n_predict=n, response_fields=kept),
                                                      **extra},
                      text(), st.sampled_from([None, -1, 0, 1, 8, -2, 10**9, *MISTYPED]), fields,
                      st.sampled_from([{}, {"samplers": ["top_k"]}, {"input_prefix": "x"}, {"prompt": 7},
                                       {"response_fields": "content"}, {"response_fields": ["x"] * 65}]))
    return st.one_of(infill.map(lambda body: Case("infill", body, route="/infill")),
                     bad.map(lambda body: Case("infill", body, route="/infill")),
                     completions.map(lambda body: Case("infill", body)),
                     llama.map(lambda body: Case("infill", body, route="/completion")))


EMBEDDING_MODEL = "tiny_embedder"
"""The embedding model the fuzzed daemon serves (doors.py starts it with --embedding-model .../tiny_embedder)."""
EMBEDDING_ROUTES = ("/v1/embeddings", "/api/embed", "/api/embeddings")


@st.composite
def _embedding_case(draw: st.DrawFn) -> Case:
    """Bodies of the embedding routes, valid but for at most one field (so the others' checks are passed):
    odd and over-long texts, token ids in and far out of the vocabulary, empty and over-full lists,
    mistyped inputs; encoding formats, dimensions and truncate of any kind, the wrong model, unknown fields."""
    route = draw(st.sampled_from(EMBEDDING_ROUTES))
    texts = st.one_of(text(), st.sampled_from(PROMPTS), st.integers(10, 40_000).map(lambda n: "the fox " * n))
    token = st.one_of(st.integers(0, 120), st.integers(0, 120), st.sampled_from([-1, 2**31, 2**63, 10**40]))
    if route == "/api/embeddings":
        body = {"model": EMBEDDING_MODEL, "prompt": draw(texts)}
    else:
        lists = st.lists(texts, max_size=6)
        if route == "/v1/embeddings":
            lists = st.one_of(lists, st.lists(token, max_size=40), st.lists(st.lists(token, max_size=30), max_size=4))
        body = {"model": EMBEDDING_MODEL, "input": draw(st.one_of(texts, lists))}
    odd: dict[str, st.SearchStrategy[Json]] = {
        "model": st.sampled_from([EMBEDDING_MODEL.upper() + ":latest", "text-embedding-3-small", "", None, 3]),
        "input" if route != "/api/embeddings" else "prompt": st.one_of(
            st.integers(2_040, 2_060).map(lambda n: ["fox"] * n),
            st.sampled_from([[], None, 7, [None], [1.5], ["x", 1], {"a": 1}, [[]], [["x"]], True])),
        "bogus": st.just(1)}
    if route != "/api/embeddings":
        odd["dimensions"] = st.sampled_from([32, 0, 8, -1, 2**63, "32", None])
    if route == "/v1/embeddings":
        odd |= {"encoding_format": st.sampled_from(["float", "base64", "hex", 1, None]), "user": st.just(5)}
    if route == "/api/embed":
        odd |= {"truncate": st.sampled_from([True, False, "no", 0]), "options": st.sampled_from([{}, {"n": 8}, "x"])}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(odd)))
        body = _request(**(body | {name: draw(odd[name])}))
    return Case("embeddings", body, route=route)


def _generation(draw: st.DrawFn) -> dict[str, Any]:
    """A prompt (/v1/completions) or a plain chat (/v1/chat/completions), and sampling options, mostly valid
    (so that the fields under test are reached), some at their edges."""
    valid = st.builds(lambda n, t: {"max_tokens": n, "temperature": t}, st.integers(1, 8), st.sampled_from([0, 0.8]))
    options = draw(st.one_of(valid, valid, sampling()))
    if draw(st.booleans()):
        return {"prompt": draw(st.sampled_from(PROMPTS)), "sampling": options}
    return {"messages": draw(plain_messages()), "sampling": options}


@st.composite
def _choices_case(draw: st.DrawFn) -> Case:
    """`n` at and past its limits (1..MAX_CHOICES), of the wrong type, streamed or not, usage asked or not."""
    n = draw(st.sampled_from([1, 2, 3, MAX_CHOICES, 0, MAX_CHOICES + 1, -1, 10**6, 2**63, 10**40, *MISTYPED]))
    body = _generation(draw) | {"n": n, "stream": draw(st.booleans())}
    if draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.sampled_from([True, False, "x"]))}
    return Case("choices", body, must_refuse=_outside(n, 1, MAX_CHOICES))


@st.composite
def _logprobs_case(draw: st.DrawFn) -> Case:
    """`logprobs` / `top_logprobs` (chat) and `logprobs` / `echo` (completions) in and out of range, mistyped,
    with `n`, streams and `max_tokens` 0 (the prompt scored) among them."""
    body = _generation(draw) | {"stream": draw(st.booleans()), "n": draw(st.sampled_from([1, 1, 2]))}
    count = draw(st.sampled_from([0, 1, 5, MAX_TOP_LOGPROBS, MAX_TOP_LOGPROBS + 1, -1, 10**9, *MISTYPED]))
    if "messages" in body:
        body |= _request(logprobs=draw(st.sampled_from([True, True, False, None, "yes", 1, 0])), top_logprobs=count)
    else:
        body |= _request(logprobs=count, echo=draw(st.sampled_from([True, True, False, None, "yes", 1])))
        if draw(st.booleans()):
            body["sampling"]["max_tokens"] = draw(st.sampled_from([0, 0, 1, -1]))
    return Case("logprobs", body, must_refuse=_outside(count, 0, MAX_TOP_LOGPROBS))


@st.composite
def _amplification_case(draw: st.DrawFn) -> Case:
    """Work and reply size multiplied by `n` × (`max_tokens` + the prompt `echo`ed) × (1 + top `logprobs`)
    (issue 45), on long prompts, streamed or not, each posing as some client by forwarded headers: served whole
    or refused (TOO_LONG past max_reply_units or the window, BUSY past max_tokens_per_client)."""
    n = draw(st.sampled_from([1, 2, 8, MAX_CHOICES]))
    sampling = {"max_tokens": draw(st.sampled_from([0, 1, 64, 200, 511, 4096]))}
    prompt = "The quick brown fox " * draw(st.integers(1, 120))
    top = draw(st.sampled_from([0, 5, MAX_TOP_LOGPROBS]))
    if draw(st.booleans()):
        body = {"prompt": prompt, "sampling": sampling, "echo": draw(st.booleans()), "logprobs": top}
    else:
        body = {"messages": [{"role": "user", "content": prompt}], "sampling": sampling, "logprobs": True,
                "top_logprobs": top}
    return Case("amplify", body | {"n": n, "stream": draw(st.booleans())}, headers=draw(forwarded_headers()))


@st.composite
def _spoof_case(draw: st.DrawFn) -> Case:
    """An ordinary generation with forwarded headers a client wrote itself (issue 45): read only from a trusted
    proxy (the fuzzed daemon trusts loopback, so they are parsed), never a failure whatever they hold."""
    return Case("spoof", _generation(draw) | {"stream": draw(st.booleans())},
                headers=draw(forwarded_headers(min_lines=1)))


def _outside(value: Any, low: int, high: int) -> bool:
    """Whether `value` is an integer (not a bool) outside low..high: refused on its face."""
    return isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high


OPENAI_FAMILIES: dict[str, st.SearchStrategy[Case]] = {
    "tokenize": _tokenize_case(), "detokenize": _detokenize_case(), "choices": _choices_case(),
    "logprobs": _logprobs_case(), "infill": _infill_case(), "embeddings": _embedding_case(),
    "amplify": _amplification_case(), "spoof": _spoof_case(),
}
"""The OpenAI door's own families (its routes and fields the other doors do not have)."""

FAMILIES: dict[str, st.SearchStrategy[Case]] = {
    "schema": _schema_case(), "tools": _tools_case(), "messages": _messages_case(), "params": _params_case(),
    "frame": _frames(),
    "ref_chain": st.integers(900, 1_600).map(_ref_chain_case),
    "deep_arguments": st.integers(900, 3_000).map(_deep_arguments_case),
    "forced_deep": st.integers(40, 850).map(_forced_deep_case),  # across the schema depth caps
    "empty_language": st.sampled_from(EMPTY_LANGUAGES).map(_empty_language_case),
}
"""Each family of cases by name; one hypothesis run per family keeps the known killers' share fixed
(a mix drawn by hypothesis clusters on a few families, since it mutates earlier examples)."""

CI_EXAMPLES = {"schema": 50, "tools": 40, "messages": 35, "params": 25, "frame": 25, "ref_chain": 4,
               "deep_arguments": 4, "forced_deep": 3, "empty_language": 7,
               "tokenize": 25, "detokenize": 25, "choices": 30, "logprobs": 35, "infill": 25, "embeddings": 40,
               "amplify": 12, "spoof": 20}
"""Cases per family and door in CI (193 of `FAMILIES` per door, 212 of `OPENAI_FAMILIES`): the random
families get most, each known killer a few."""
