"""fly_llm.common.tools helpers the adapters, clients and CLI share: tool_choice_for, offer_tools, closed_schema,
closed_tool, schema_format, and the structure options declared once (no daemon)."""

from __future__ import annotations

from types import SimpleNamespace

import jsonschema
import pytest
from fly_daemon.http.openai_api import ChatCompletionRequest, CompletionRequest
from pydantic import ValidationError

from fly_llm.client.core import call_options, generate_request
from fly_llm.common.config import REQUEST_OPTIONS
from fly_llm.common.errors import BadRequest
from fly_llm.common.tools import (
    MAX_DESCRIPTION, STRUCTURE_OPTIONS, FormatOptions, StructureOptions, ToolSpec, closed_schema, closed_tool,
    offer_tools, schema_format, tool_choice_for,
)

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
def test_offer_tools_names_the_tool_and_the_reason(tools, choice, words):
    with pytest.raises(ValueError) as err:
        offer_tools(tools, choice)
    assert words in str(err.value)


def test_offer_tools_gives_the_wire_options():
    assert offer_tools([ADD]) == {"tools": [ADD]}
    named = {"type": "function", "function": {"name": "add"}}
    assert offer_tools([ADD], "add") == {"tools": [ADD], "tool_choice": named}
    with pytest.raises(ValueError, match="list of tools"):
        offer_tools({"add": ADD})  # a tools file holding an object


def test_offer_tools_leaves_duplicates_to_the_request():
    offer_tools([ADD, ADD], "required")  # frameworks bind such lists without sending them


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


def test_closed_tool_and_schema_format_close_parameters_and_schemas():
    closed = closed_tool(ADD)
    assert closed["function"]["parameters"]["additionalProperties"] is False and "additionalProperties" not in \
        ADD["function"]["parameters"]
    assert closed_tool({"type": "function"}) == {"type": "function"}  # no parameters: as it is
    schema = ADD["function"]["parameters"]
    assert schema_format(schema) == {"type": "json_schema", "schema": closed_schema(schema)}
    assert schema_format(schema, "Add")["name"] == "Add"


OPTION_VALUES = {"tools": [ADD], "tool_choice": "required", "parallel_tool_calls": False,
                 "response_format": {"type": "json_object"}}
"""A value for each structure option (tools and response_format are not given together)."""


def test_every_structure_option_has_an_example_here():
    assert set(OPTION_VALUES) == set(STRUCTURE_OPTIONS)


@pytest.mark.parametrize("name", STRUCTURE_OPTIONS)
def test_each_structure_option_reaches_the_request_from_the_client_and_the_adapters(name):
    """Declared once in StructureOptions: the wire request carries each, the clients' keywords and the
    adapters' merging pass each on (a field or a call's keyword), with no list of names elsewhere."""
    value = OPTION_VALUES[name]
    needs = {"tools": [ADD]} if name == "tool_choice" else {}
    messages = [{"role": "user", "content": "hi"}]
    sent = generate_request(None, messages, None, None, 5.0, **needs, **{name: value})
    assert getattr(sent.structure, name) == getattr(StructureOptions.model_validate({name: value}), name)
    unset = SimpleNamespace(**dict.fromkeys(REQUEST_OPTIONS), timeout=None)  # an adapter's fields, all unset
    assert call_options(unset, {name: value})[name] == value  # a call's keyword
    assert call_options(SimpleNamespace(**vars(unset), **{name: value}), {})[name] == value  # an adapter's field
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **needs, name: value})
    assert body.to_generate("h", 4096).structure == sent.structure  # the HTTP front's chat completions


def test_unknown_structure_keywords_are_type_errors_and_bad_values_bad_requests():
    with pytest.raises(TypeError, match="unknown option.*temperature.*accepted: " + ", ".join(STRUCTURE_OPTIONS)):
        generate_request("x", None, None, None, 5.0, temperature=0.5)
    with pytest.raises(BadRequest, match="tools need chat messages"):
        generate_request("x", None, None, None, 5.0, tools=[ADD])
    with pytest.raises(BadRequest, match="parallel_tool_calls"):
        generate_request("x", None, None, None, 5.0, parallel_tool_calls="sometimes")


def test_a_plain_prompt_takes_the_format_options():
    """Completions (a prompt, no chat template) take FormatOptions' fields; the HTTP route refuses the others."""
    assert set(FormatOptions.model_fields) < set(STRUCTURE_OPTIONS)
    request = generate_request("x", None, None, None, 5.0, response_format={"type": "json_object"})
    assert request.structure.response_format.type == "json_object"
    body = {"model": "m", "prompt": "x"}
    for name in FormatOptions.model_fields:
        completion = CompletionRequest.model_validate({**body, name: OPTION_VALUES[name]}).to_generate("c", 4096)
        assert getattr(completion.structure, name) is not None
    for name in set(STRUCTURE_OPTIONS) - set(FormatOptions.model_fields):
        with pytest.raises(ValidationError, match="Extra inputs"):
            CompletionRequest.model_validate({**body, name: OPTION_VALUES[name]})


def test_an_agents_long_tool_description_is_accepted_and_a_pathological_one_refused():
    """Claude Code describes its Bash tool in 18,780 characters (the prompt's token limit bounds a request, not a
    field); past MAX_DESCRIPTION a description is refused."""
    spec = {"type": "function", "function": {"name": "Bash", "description": "d " * 9390}}
    assert len(ToolSpec.model_validate(spec).function.description) == 18780
    too_long = {"type": "function", "function": {"name": "Bash", "description": "d" * (MAX_DESCRIPTION + 1)}}
    with pytest.raises(ValidationError, match="description"):
        ToolSpec.model_validate(too_long)
