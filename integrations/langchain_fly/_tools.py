"""Tools in OpenAI's shape, as ChatFLy offers them to the daemon."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool

from fly_llm.common.tools import closed_tool


def openai_tool(tool: dict[str, Any] | type | Callable | BaseTool, strict: bool | None) -> dict[str, Any]:
    """A tool in OpenAI's shape with closed parameter objects (`closed_tool`); ValueError naming the
    tool when LangChain cannot convert it."""
    try:
        spec = convert_to_openai_tool(tool, strict=strict)
    except Exception as exc:  # noqa: BLE001 - LangChain raises several kinds for unconvertible tools
        name = getattr(tool, "name", None) or getattr(tool, "__name__", None) or repr(tool)[:60]
        raise ValueError(f"tool {name!r} cannot be offered: {exc}") from exc
    return closed_tool(spec)
