"""`ChatFLy.with_structured_output`: a schema in, parsed objects out, the output made valid by a grammar.

Methods:

- `json_schema` (default): the answer is JSON valid under the schema (`response_format` json_schema;
  objects with `properties` closed, see `fly_llm.common.tools.schema_format`).
- `function_calling`: the model must call one tool whose arguments are the schema (a named `tool_choice`).
- `json_mode`: the answer is any JSON object (`response_format` json_object); describe the shape in the prompt.

Pydantic classes come back as instances, TypedDicts and JSON schemas as dicts.
"""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.base import OutputParserLike
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass

from fly_llm.common.tools import schema_format
from langchain_fly._tools import openai_tool

if TYPE_CHECKING:
    from langchain_fly.chat_models import ChatFLy

Method = Literal["json_schema", "function_calling", "json_mode"]


def structured_output(model: ChatFLy, schema: Any, method: Method, include_raw: bool) -> Runnable:
    """The runnable behind `ChatFLy.with_structured_output` (see there)."""
    if schema is None and method != "json_mode":
        raise ValueError(f"method {method!r} needs a schema (only 'json_mode' works without one)")
    pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    traced = {} if schema is None else {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
    if method == "function_calling":
        name = openai_tool(schema, None)["function"]["name"]
        bound: Runnable = model.bind_tools([schema], tool_choice=name, **traced)
        parser: OutputParserLike = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                                    else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
    elif method in ("json_schema", "json_mode"):
        response_format = schema_format(_json_schema(schema)) if method == "json_schema" else {"type": "json_object"}
        bound = model.bind(response_format=response_format, **traced)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
    else:
        raise ValueError(f"unknown method {method!r}: use 'json_schema', 'function_calling' or 'json_mode'")
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    failed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([failed], exception_key="parsing_error")


def _json_schema(schema: Any) -> dict[str, Any]:
    """The JSON schema of a pydantic class, TypedDict, OpenAI tool or JSON schema; ValueError naming it if none."""
    if isinstance(schema, dict) and "function" not in schema and "title" not in schema:
        return schema  # a plain JSON schema without a title is used as it is
    try:
        return convert_to_json_schema(schema)
    except Exception as exc:  # noqa: BLE001 - LangChain raises several kinds for unconvertible schemas
        raise ValueError(f"cannot turn {getattr(schema, '__name__', schema)!r} into a JSON schema: {exc}") from exc

