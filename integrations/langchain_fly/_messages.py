"""LangChain messages to the daemon's chat turns, and the daemon's answers to LangChain messages.

Tool calls travel both ways: an `AIMessage`'s `tool_calls` and a `ToolMessage`'s result go to the
daemon in OpenAI's shape; a result's parsed calls come back as `tool_calls`, and the calls the daemon
could not parse (their text stays in the answer, e.g. cut off by `max_tokens`; the daemon lists them
as the result's `invalid_tool_calls`) as `invalid_tool_calls`. No tool-call format is known here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage as LCChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk

from fly_llm.common.protocol import ChatMessage, GenerateResult, TokenChunk

_ROLES: dict[type[BaseMessage], str] = {
    SystemMessage: "system", HumanMessage: "user", AIMessage: "assistant", ToolMessage: "tool",
}
_SKIPPED_BLOCKS = frozenset({"tool_use", "tool_call", "tool_call_chunk", "invalid_tool_call", "thinking", "reasoning"})
"""Content blocks of an answer that are not sent back: its tool calls (Anthropic's `tool_use`, LangChain
v1 blocks; the calls travel as `tool_calls`) and its reasoning (chat templates drop earlier turns' reasoning)."""


def to_wire(messages: Sequence[BaseMessage]) -> list[ChatMessage]:
    """LangChain messages as the daemon's chat turns (text, tool calls and tool results; names are dropped)."""
    turns = []
    for m in messages:
        turn: dict[str, Any] = {"role": _role(m), "content": _text(m)}
        if isinstance(m, AIMessage) and m.tool_calls:
            turn["tool_calls"] = [{"id": c["id"] or f"call_{i}", "name": c["name"], "arguments": c["args"]}
                                  for i, c in enumerate(m.tool_calls)]
        if isinstance(m, ToolMessage):
            turn["tool_call_id"] = m.tool_call_id
        turns.append(ChatMessage.model_validate(turn))
    return turns


def _role(message: BaseMessage) -> str:
    if isinstance(message, LCChatMessage) and message.role in ("system", "user", "assistant", "tool"):
        return message.role
    for cls, role in _ROLES.items():
        if isinstance(message, cls):
            return role
    raise ValueError(f"ChatFLy cannot send a {type(message).__name__} to the daemon")


def _text(message: BaseMessage) -> str:
    """The message's text. An AIMessage's tool-call and reasoning blocks are skipped (`_SKIPPED_BLOCKS`);
    any other non-text block is an error (the models read text only)."""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block["text"])
        elif not (isinstance(message, AIMessage) and block.get("type") in _SKIPPED_BLOCKS):
            raise ValueError(f"ChatFLy takes text only; got a {block.get('type')!r} content block")
    return "".join(parts)


def ai_message(result: GenerateResult, **fields: Any) -> AIMessage:
    """The AIMessage for a finished request: its text, its calls, and the calls that did not parse."""
    return AIMessage(
        content=result.text,
        tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id) for c in result.tool_calls],
        invalid_tool_calls=[invalid_tool_call(name=c.name, args=c.arguments, id=None, error=c.error)
                            for c in result.invalid_tool_calls],
        **fields)


def message_chunk(item: TokenChunk, first_index: int) -> AIMessageChunk | None:
    """A streamed text delta and the calls completed in it (indexed from `first_index`), or None when empty."""
    if not item.text and not item.tool_calls:
        return None
    chunks = [tool_call_chunk(name=c.name, args=json.dumps(c.arguments), id=c.id, index=first_index + i)
              for i, c in enumerate(item.tool_calls)]
    return AIMessageChunk(content=item.text, tool_call_chunks=chunks)
