"""Untrusted JSON text (fly_llm.common.json_text) and where it is read on the wire: bounded nesting, ValueError only."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from fly_llm.common.errors import BadRequest
from fly_llm.common.json_text import MAX_DEPTH, count_values, loads, loads_objects
from fly_llm.common.protocol import MessageToolCall, decode_request


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_nesting_up_to_the_limit_parses_and_deeper_is_a_value_error():
    assert loads(_nested(MAX_DEPTH)) is not None
    for depth in (MAX_DEPTH + 2, 1_200, 100_000):  # jiter's limit: arrays may go one deeper
        with pytest.raises(ValueError, match="recursion limit"):
            loads(_nested(depth))


@pytest.mark.parametrize("text", ['"\\ud800"', '{"x": NaN}', "[1] 2", "", "\ud800"])
def test_what_a_frame_refuses_is_refused(text):
    with pytest.raises(ValueError):
        loads(text)


def test_objects_one_after_another():
    assert loads_objects(' {"a": ["}", "\\"{"]}\n{} ') == [{"a": ["}", '"{']}, {}]
    assert loads_objects("") == []
    for text in ["{} x", "[1]", '"s" {}', "{", '{"a": "', "{" * 100_000, "}", "{}" + _nested(MAX_DEPTH + 1)]:
        with pytest.raises(ValueError):
            loads_objects(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]":,\\ 0123456789.-etruflsna\u00e9\ud800', max_size=400))
def test_any_text_parses_or_is_a_value_error(text):
    for read in (loads, loads_objects):
        try:
            read(text)
        except ValueError:
            pass


def _with_arguments(arguments: str) -> bytes:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return json.dumps({"v": 1, "id": "deep", "kind": "generate", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}).encode()


def test_deeply_nested_tool_arguments_in_a_frame_are_a_bad_request():
    """Issue 33 finding 2: a 2.4 KB frame of `[[[[…` arguments raised RecursionError out of the validator."""
    frame = _with_arguments('{"x": ' + _nested(1_200) + "}")
    assert len(frame) < 3_000
    with pytest.raises(BadRequest, match="arguments are not JSON"):
        decode_request(frame)


def test_tool_arguments_nested_within_the_limit_are_read():
    request = decode_request(_with_arguments('{"x": ' + _nested(MAX_DEPTH - 1) + "}"))
    assert isinstance(request.messages[1].tool_calls[0].function.arguments["x"], list)
    with pytest.raises(BadRequest, match="arguments are not JSON"):  # a lone surrogate
        decode_request(_with_arguments('{"x": "\\ud800"}'))
    assert MessageToolCall.model_validate({"id": "c", "name": "f", "arguments": ' {"a": 1}'}).function.arguments == {"a": 1}


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=3),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
                    max_leaves=30), st.integers(0, 60))
def test_count_values_counts_every_value_and_key_up_to_the_limit(value, limit):
    def every(v) -> int:
        if isinstance(v, dict):
            return 1 + len(v) + sum(every(x) for x in v.values())
        if isinstance(v, list):
            return 1 + sum(every(x) for x in v)
        return 1

    assert count_values(value, limit) == (every(value) if every(value) <= limit else limit + 1)


def test_count_values_stops_at_the_limit():
    assert count_values([[0] * 10] * 10**6, 100) == 101  # the outer list alone passes it: nothing inside is visited


def test_a_refusal_names_the_first_few_problems_and_the_first_field():
    from pydantic import BaseModel, ConfigDict, ValidationError

    from fly_llm.common.errors import TooLong
    from fly_llm.common.protocol import invalid

    class Body(BaseModel):
        model_config = ConfigDict(strict=True)
        items: list[int]
        name: str = ""

    with pytest.raises(ValidationError) as many:
        Body.model_validate({"items": ["x"] * 100_000})
    error = invalid(many.value)
    assert error.param == "items.0" and error.message.count(": ") == 5 and "items.4:" in error.message
    with pytest.raises(ValidationError) as long_name:
        type("Short", (BaseModel,), {"__annotations__": {"name": str},
                                     "model_config": ConfigDict(str_max_length=3)}).model_validate({"name": "abcd"})
    assert isinstance(invalid(long_name.value), TooLong) and invalid(long_name.value).param == "name"
