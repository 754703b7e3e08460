"""LlamaIndex chat messages to the daemon's turns and back, tool calls included.

A call the model made is a `ToolCallBlock` in the answer's blocks (LlamaIndex's own form, which
its agents keep in memory and send back); a tool result is a `tool` message whose
`additional_kwargs["tool_call_id"]` names the call, as `FunctionAgent` writes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection

from fly_llm.common.protocol import ToolCall

_ROLES = {
    MessageRole.DEVELOPER: "system",
    MessageRole.FUNCTION: "tool",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}
"""LlamaIndex roles the daemon's chat template knows under another name."""


def to_wire(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex messages as the daemon's chat turns: text, the calls an answer made, a result's call id."""
    turns = []
    for m in messages:
        turn: dict[str, Any] = {"role": _ROLES.get(m.role, m.role.value), "content": m.content or ""}
        calls = [b for b in m.blocks if isinstance(b, ToolCallBlock)]
        if calls:
            turn["tool_calls"] = [{"id": b.tool_call_id or f"call_{i}", "name": b.tool_name,
                                   "arguments": b.tool_kwargs} for i, b in enumerate(calls)]
        if turn["role"] == "tool" and m.additional_kwargs.get("tool_call_id"):
            turn["tool_call_id"] = m.additional_kwargs["tool_call_id"]
        turns.append(turn)
    return turns


def answer(text: str, calls: Sequence[ToolCall]) -> ChatMessage:
    """The assistant message for generated text and the calls made so far."""
    blocks: list[Any] = [TextBlock(text=text)] if text or not calls else []
    blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in calls]
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)


def tool_selections(message: ChatMessage) -> list[ToolSelection]:
    """The calls in an answer, as LlamaIndex's agents and `predict_and_call` take them."""
    return [ToolSelection(tool_id=b.tool_call_id or "", tool_name=b.tool_name,
                          tool_kwargs=json.loads(b.tool_kwargs or "{}") if isinstance(b.tool_kwargs, str)
                          else b.tool_kwargs)
            for b in message.blocks if isinstance(b, ToolCallBlock)]

