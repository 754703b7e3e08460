"""Structured prediction through `response_format`: the answer is JSON decoded under the output class's schema."""

from __future__ import annotations

from typing import Any, Type

from llama_index.core.base.llms.types import ChatResponse
from llama_index.core.bridge.pydantic import BaseModel, ValidationError
from llama_index.core.program.utils import process_streaming_objects

from fly_llm.common.tools import schema_format


def response_format_for(output_cls: Type[BaseModel]) -> dict[str, Any]:
    """The json_schema response format of a pydantic class (objects closed: `schema_format`)."""
    return schema_format(output_cls.model_json_schema(), output_cls.__name__)


def parse_structured(output_cls: Type[BaseModel], response: ChatResponse) -> BaseModel:
    """The answer as an `output_cls`; a ValueError says why not (e.g. cut off at max_tokens)."""
    try:
        return output_cls.model_validate_json(response.message.content or "")
    except ValidationError as exc:
        reason = (response.raw or {}).get("finish_reason")
        raise ValueError(f"the answer is not a valid {output_cls.__name__} (finish_reason {reason!r}): "
                         f"{exc.errors()[0]['msg']}") from exc


def parse_partial(output_cls: Type[BaseModel], response: ChatResponse, latest: BaseModel | None) -> BaseModel:
    """The object so far of a streamed answer (fields still missing stay unset), or `latest` if it does not parse yet."""
    return process_streaming_objects(response, output_cls, cur_objects=None if latest is None else [latest],
                                     flexible_mode=True)
