"""Tools whose arguments are nested pydantic models (`$defs` / `$ref` in their parameters), through the
LlamaIndex and LangChain adapters, on the tiny random-weight daemon (issue 33 finding 4).

Random weights know nothing: a call is valid only because the daemon decodes it under the tool's
grammar, so each call's arguments must validate against the schema the adapter sent. Strings
are short (max_length) and lists bounded: a free-length string from random weights never ends.
(No `from __future__ import annotations`: FunctionTool reads the annotations at run time.)
"""

import jsonschema
import pytest
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel

from langchain_fly import ChatFLy
from llama_index.llms.fly import FLyLLM
from support.nested_models import Person

ASK = "Save Ann, who lives in Rome."


def save(person: Person) -> str:
    """Save a person."""
    return person.name


class save_person(BaseModel):  # noqa: N801 - a LangChain tool's name is its class name
    """Save a person."""

    person: Person


def test_llama_index_function_tool_over_nested_models(tiny_daemon):
    """FunctionTool's parameters keep pydantic's `$defs`: the daemon hoists them and the call validates.
    On the old code: BAD_REQUEST "Pointer '/$defs/Person' does not exist"."""
    tool = FunctionTool.from_defaults(save)
    schema = tool.metadata.get_parameters_dict()
    assert "$defs" in schema
    llm = FLyLLM(endpoint=tiny_daemon, max_tokens=300, timeout=120)
    response = llm.chat_with_tools([tool], ASK, tool_choice="save")
    [call] = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "save"
    jsonschema.validate(call.tool_kwargs, schema)
    Person.model_validate(call.tool_kwargs["person"])


def test_langchain_bind_tools_over_nested_models(tiny_daemon):
    bound = ChatFLy(endpoint=tiny_daemon, max_tokens=300, timeout=120).bind_tools([save_person], tool_choice="save_person")
    [offered] = bound.kwargs["tools"]
    message = bound.invoke(ASK)
    [call] = message.tool_calls
    assert call["name"] == "save_person"
    jsonschema.validate(call["args"], offered["function"]["parameters"])
    save_person.model_validate(call["args"])


class Street(BaseModel):
    """A postal address."""

    street: str
    city: str
    country: str


class Contact(BaseModel):
    """A person to add to the address book."""

    name: str
    address: Street


SAVED: list[Contact] = []


def save_contact(contact: Contact) -> str:
    """Add a contact (a person with their postal address) to the address book."""
    contact = Contact.model_validate(contact)  # LlamaIndex passes the validated arguments as plain dicts
    SAVED.append(contact)
    return f"saved {contact.name}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_llama_index_agent_calls_a_nested_model_tool_on_the_embedded_pair(real_daemon):
    """A FunctionAgent on the embedded pair calls a tool whose argument is a nested pydantic model, with the
    facts of the request in the right fields."""
    from llama_index.core.agent.workflow import FunctionAgent

    tool = FunctionTool.from_defaults(save_contact)
    assert "$defs" in tool.metadata.get_parameters_dict()
    llm = FLyLLM(endpoint=real_daemon, max_tokens=256, temperature=0, timeout=1500)
    agent = FunctionAgent(tools=[tool], llm=llm, system_prompt="You manage an address book with your tools.")
    SAVED.clear()
    await agent.run("Add Ann Smith to the address book: she lives at 12 Via Roma, Rome, Italy.")
    assert SAVED, "the agent never called the tool"
    for contact in SAVED:  # the 1.5B model may repeat a call; every call must carry the request's facts
        assert "Ann" in contact.name and contact.address.city == "Rome" and contact.address.country == "Italy"
        assert "Via Roma" in contact.address.street
