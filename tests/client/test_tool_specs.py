"""fly_llm.tools helpers the adapters share: tool_choice_for, check_tools, closed_schema (no daemon)."""

from __future__ import annotations

import jsonschema
import pytest

from fly_llm.tools import check_tools, closed_schema, tool_choice_for

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}


@pytest.mark.parametrize("choice, wire", [
    (None, None), (False, None), ("auto", "auto"), ("none", "none"), ("required", "required"),
    ("any", "required"), (True, "required"), ("add", {"type": "function", "function": {"name": "add"}}),
    ({"type": "function", "function": {"name": "add"}}, {"type": "function", "function": {"name": "add"}}),
])
def test_tool_choice_for_maps_framework_words(choice, wire):
    assert tool_choice_for(choice, ["add"]) == wire


def test_tool_choice_for_names_the_options_of_an_unknown_choice():
    with pytest.raises(ValueError, match=r"'nope'.*'auto'.*name of an offered tool \(add, lookup\)"):
        tool_choice_for("nope", ["add", "lookup"])


@pytest.mark.parametrize("tools, choice, words", [
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tool 'bad name!': function.name"),
    ([{"type": "function", "function": {"name": "x", "parameters": {}, "extra": 1}}], None, "tool 'x': function.extra"),
    ([{"type": "function"}], None, "tool '#0': function"),
    ([ADD], {"type": "function", "function": {"name": "nope"}}, "unknown tool 'nope'"),
    ([ADD], "sometimes", "tool_choice 'sometimes'"),
])
def test_check_tools_names_the_tool_and_the_reason(tools, choice, words):
    with pytest.raises(ValueError) as err:
        check_tools(tools, choice)
    assert words in str(err.value)


def test_check_tools_leaves_duplicates_to_the_request():
    check_tools([ADD, ADD], "required")  # frameworks bind such lists without sending them


def test_closed_schema_closes_objects_with_properties_only():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a key named "properties"
        "free": {"type": "object"},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "rows": {"type": "array", "items": {"$ref": "#/$defs/Row"}},
        "either": {"anyOf": [{"type": "object", "properties": {"k": {"type": "string"}}}, {"type": "null"}]},
    }, "$defs": {"Row": {"type": "object", "properties": {"n": {"type": "integer"}}}},
        "default": {"properties": {}}}
    closed = closed_schema(schema)
    validator = jsonschema.Draft202012Validator(closed)
    assert closed["additionalProperties"] is False and schema.get("additionalProperties") is None  # a copy
    assert validator.is_valid({"properties": {"x": 1}, "free": {"any": 1}, "open": {"y": 2},
                               "rows": [{"n": 1}], "either": {"k": "v"}})
    for extra in [{"zzz": 1}, {"properties": {"x": 1, "y": 2}}, {"rows": [{"n": 1, "m": 2}]},
                  {"either": {"k": "v", "j": 1}}]:
        assert not validator.is_valid(extra), extra
    assert closed["default"] == {"properties": {}}  # data is not a schema
