"""A LangChain agent (`create_agent`) with two tools, on the fly daemon, offline.

The tools are a calculator and a lookup in a local stock list the model cannot know, so the
question needs both. The daemon decodes every tool call under a grammar of the offered tools:
a call the model starts is always a call of an offered tool with schema-valid arguments.

    fly-daemon start                  # the embedded Qwen2.5-Coder pair
    python examples/langchain_agent.py "How many widgets and gadgets are in stock together, times 3?"

Each step streams as it happens: the model's calls with their arguments, each tool's result,
the final answer. Needs the `langchain` package (1.x) for `create_agent`: `pip install -e .[agents]`.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
from collections.abc import Iterator
from typing import Any, Literal

from langchain.agents import create_agent
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from langchain_fly import ChatFLy

STOCK = {"widget": 412, "gadget": 97, "sprocket": 1305, "gizmo": 28}
"""The local data the lookup tool reads (made up, so the model cannot know it)."""

QUESTION = "How many widgets and gadgets are in stock together, and what is that number times 3?"
SYSTEM = ("You answer questions about the warehouse. Tools cannot call each other: first call stock_level "
          "once for each item you need, then call calculator with the numbers it returned. Never guess a "
          "number. Answer in one short sentence.")

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / ** and parentheses, e.g. "(2 + 5) * 4"."""
    try:
        return _number(_evaluate(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ArithmeticError) as exc:  # told to the model, which may try again
        return f"error: {exc}"


@tool
def stock_level(item: Literal["widget", "gadget", "sprocket", "gizmo"]) -> int:
    """How many of an item are in stock in the warehouse."""
    return STOCK[item]


TOOLS = [stock_level, calculator]


def _evaluate(node: ast.AST) -> float:
    """A number from a parsed arithmetic expression; ValueError for anything else (no names, no calls)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)} (call that tool first and use the number it returns)")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def build_agent(chat: ChatFLy):
    """The agent graph: the chat model, the two tools, the system prompt."""
    return create_agent(chat, TOOLS, system_prompt=SYSTEM)


def run_steps(agent, question: str) -> Iterator[BaseMessage]:
    """The agent's new messages, step by step, as they are produced."""
    for update in agent.stream({"messages": [HumanMessage(question)]}, stream_mode="updates"):
        for step in update.values():
            yield from (step or {}).get("messages", [])


def describe(message: BaseMessage) -> str:
    """One line per step for the terminal."""
    if isinstance(message, AIMessage) and message.tool_calls:
        return "\n".join(f"-> {c['name']}({json.dumps(c['args'])})" for c in message.tool_calls)
    if isinstance(message, ToolMessage):
        return f"<- {message.name}: {message.content}"
    return f"answer: {message.content}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--endpoint", help="daemon endpoint (default: $FLY_ENDPOINT or the local socket)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one model turn may take")
    args = parser.parse_args(argv)

    options: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": 0.0, "timeout": args.timeout}
    if args.endpoint:
        options["endpoint"] = args.endpoint
    agent = build_agent(ChatFLy(**options))
    print(f"question: {args.question}", flush=True)
    for message in run_steps(agent, args.question):
        print(describe(message), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
