"""fly_llm.common.tool_formats.hermes and fly_llm.common.tools: tool calls found in streamed text, request structure
validation (no torch, no daemon)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from fly_llm.common.json_text import MAX_DEPTH
from fly_llm.common.tool_formats.hermes import TOOL_CLOSE, TOOL_OPEN, ToolCallStream, parse_call, split_tool_calls
from fly_llm.common.tools import Structure

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def _stream(text: str, cuts: list[int], names: frozenset[str] = frozenset()):
    stream = ToolCallStream(names)
    shown, calls = [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        out, new = stream.feed(text[a:b])
        shown.append(out)
        calls += new
    rest, last = stream.finish()
    return "".join(shown) + rest, calls + last


@pytest.mark.parametrize("seed", range(20))
def test_any_split_of_the_stream_gives_the_same_text_and_calls(seed):
    text = f"Let me see. {CALL}\n{CALL.replace('1', '2')} and <tool_ca then text <tool_call>{{bad</tool_call>"
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 30)))
    shown, calls = _stream(text, cuts)
    assert [c.arguments for c in calls] == [{"x": 1}, {"x": 2}]
    assert shown == "Let me see. \n and <tool_ca then text <tool_call>{bad</tool_call>"  # unparsed blocks stay text
    assert split_tool_calls(text)[1][0].arguments == {"x": 1}


def test_an_unclosed_call_at_the_end_is_text():
    shown, calls = _stream("a " + CALL[:-5], [3, 10])
    assert not calls and shown == "a " + CALL[:-5]


@pytest.mark.parametrize("answer", ['{"name": "f", "arguments": {"x": 1}}', '```json\n{"name": "f", "arguments": {"x": 1}}\n```',
                                    '  {"name": "f", "arguments": {"x": 1}}'])
def test_a_bare_call_of_an_offered_tool_counts_with_auto(answer):
    shown, calls = _stream(answer, [1, 5], frozenset({"f"}))
    assert shown == "" and [(c.name, c.arguments) for c in calls] == [("f", {"x": 1})]
    shown, calls = _stream(answer, [1, 5])  # without names (required / named choice): no fallback
    assert shown == answer and not calls


def test_several_bare_calls_count_when_all_are_offered_tools():
    answer = '{"name": "f", "arguments": {"x": 1}}\n{"name": "f", "arguments": {"x": 2}}'
    shown, calls = _stream(answer, [7], frozenset({"f"}))
    assert shown == "" and [c.arguments for c in calls] == [{"x": 1}, {"x": 2}]
    mixed = answer + '\n{"name": "g", "arguments": {}}'
    assert _stream(mixed, [7], frozenset({"f"})) == (mixed, [])


@pytest.mark.parametrize("answer", ['{"name": "g", "arguments": {}}', '```json\n[1, 2]\n```', "```python\nprint(1)\n```"])
def test_other_json_or_code_stays_text(answer):
    assert _stream(answer, [2], frozenset({"f"})) == (answer, [])


@pytest.mark.parametrize("structure, problem", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"function": {"name": "f"}}] * 2}, "duplicate"),
    ({"tools": [{"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "unknown tool"),
    ({"tools": [{"function": {"name": "bad name!"}}]}, "pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
])
def test_bad_structures_name_the_problem(structure, problem):
    with pytest.raises(ValidationError, match=problem):
        Structure.model_validate(structure)


def test_openai_nested_json_schema_is_accepted():
    fmt = Structure.model_validate({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object"}}}}).response_format
    assert fmt.json_schema_ == {"type": "object"} and fmt.name == "a"


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("body", [f'{{"name": "f", "arguments": {{"x": {DEEP}}}}}', DEEP, "{" * 5000],
                         ids=["deep arguments", "deep array", "unclosed objects"])
def test_deep_nesting_in_model_output_is_text_not_a_crash(body):
    text = f"{TOOL_OPEN}{body}{TOOL_CLOSE}"
    with pytest.raises(ValueError):
        parse_call(body)
    assert split_tool_calls(text) == (text, [])
    assert _stream(body, [len(body) // 2], frozenset({"f"})) == (body, [])  # a bare answer, too


def test_a_call_nested_up_to_the_limit_parses():
    depth = MAX_DEPTH - 3  # the call object and "arguments" hold the rest
    body = f'{{"name": "f", "arguments": {{"x": {"[" * depth}{"]" * depth}}}}}'
    assert parse_call(body).name == "f"


_JSONISH = st.text(alphabet='{}[]":,\\ ntrue0123456789.-<>/_abcfl\u00e9\ufffd\U0001f642', max_size=300)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.one_of(_JSONISH, st.sampled_from([TOOL_OPEN, TOOL_CLOSE, "```json", CALL, DEEP, "[" * 3000, "]" * 3000,
                                                               "{" * 3000, '{"name": "f", "arguments": '])),
                       max_size=12),
       offered=st.booleans())
def test_the_call_parsers_raise_nothing_undocumented_on_any_text(pieces, offered):
    """feed/finish and split_tool_calls never raise; parse_call raises only ValueError."""
    text = "".join(pieces)
    names = frozenset({"f"}) if offered else frozenset()
    stream = ToolCallStream(names)
    for piece in pieces:
        stream.feed(piece)
    stream.finish()
    split_tool_calls(text)
    try:
        parse_call(text)
    except ValueError:
        pass
