"""Untrusted schemas at the HTTP front (issue 33 findings 1, 4, 5): the OpenAI SDK's
`pydantic_function_tool` over nested models works; a `$ref` chain that crashed the grammar
compiler, an empty language and a grammar that dies mid-output are 400s, and the daemon goes on.
A tool whose schema uses keywords the grammar engine does not implement (Claude Code's `propertyNames`) is
served loosened under tool_choice auto, and refused, naming them, when a call to it is forced (issue 64).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from support.nested_models import Person
from support.daemon_process import free_port, start_daemon

ASK = [{"role": "user", "content": "Save Ann, who lives in Rome."}]


@pytest.fixture(scope="module")
def client(tiny_pair_dirs, tmp_path_factory):
    port = free_port()
    daemon = start_daemon(*tiny_pair_dirs, tmp_path_factory.mktemp("tool_defs"), "t", "--http", f"127.0.0.1:{port}")
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_pydantic_function_tool_with_nested_models(client, model):
    """On the old code: 400 "Pointer '/$defs/Address' does not exist"."""
    tool = openai.pydantic_function_tool(Person, name="save")
    answer = client.chat.completions.create(model=model, messages=ASK, tools=[tool], max_tokens=300,
                                            tool_choice={"type": "function", "function": {"name": "save"}})
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "save"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    Person.model_validate(arguments)


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize("response_format, problem", [
    ({"type": "json_schema", "json_schema": {"name": "chain", "schema": ref_chain(1100)}}, "too large"),
    ({"type": "json_schema", "json_schema": {"name": "empty", "schema": {"$ref": "#"}}}, "language is empty"),
])
def test_hostile_schemas_are_400s_and_the_daemon_goes_on(client, model, response_format, problem):
    """The issue's ~1,100-link chain killed the daemon (SIGSEGV); a self-reference ended silently with 'stop'."""
    with pytest.raises(openai.BadRequestError, match=problem):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=20, response_format=response_format)
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=4).choices[0].message.content


def test_a_grammar_that_fails_mid_output_is_a_400_not_a_silent_stop(client, model):
    dead_end = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
                "additionalProperties": False, "$defs": {"x": {"$ref": "#/$defs/x"}}}
    with pytest.raises(openai.BadRequestError, match="no continuation"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=40, response_format={
            "type": "json_schema", "json_schema": {"name": "dead", "schema": dead_end}})


# What llguidance refuses ("Unimplemented keys"), as Claude Code's tools and pydantic's models write them.
UNCOMPILED = {"type": "object", "properties": {
    "env": {"type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"}, "additionalProperties": {"type": "string"}},
    "tags": {"type": "array", "items": {"enum": ["fox", "dog"]}, "uniqueItems": True, "maxItems": 2},
    "mode": {"enum": ["a", "b"]}}, "required": ["mode"], "dependentRequired": {"env": ["mode"]},
    "if": {"properties": {"mode": {"const": "a"}}}, "then": {"required": ["tags"]}, "additionalProperties": False}
LOOSE_TOOLS = [{"type": "function", "function": {"name": "run", "description": "Run.", "parameters": UNCOMPILED}},
               {"type": "function", "function": {"name": "ping", "description": "Ping.",
                                                 "parameters": {"type": "object", "properties": {}}}}]


def test_a_tool_the_grammar_engine_cannot_compile_is_loosened_under_auto(client, model):
    """On the old code: 400 "tool 'run': its parameters schema cannot be used: ... Unimplemented keys"."""
    for choice in ("auto", None):
        answer = client.chat.completions.create(model=model, messages=ASK, tools=LOOSE_TOOLS, max_tokens=200,
                                                **({} if choice is None else {"tool_choice": choice}))
        for call in answer.choices[0].message.tool_calls or ():
            arguments = json.loads(call.function.arguments)
            if call.function.name == "run":  # held to the schema's other keywords
                assert arguments["mode"] in ("a", "b") and set(arguments) <= {"env", "tags", "mode"}
    with pytest.raises(openai.BadRequestError, match="Unimplemented keys"):
        client.chat.completions.create(model=model, messages=ASK, tools=LOOSE_TOOLS, max_tokens=20,
                                       tool_choice={"type": "function", "function": {"name": "run"}})
