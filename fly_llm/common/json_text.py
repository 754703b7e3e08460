"""Reading JSON text that nobody vouches for: JSON strings inside frames, tool calls in model output (no torch).

The standard library's parser recurses once per nesting level, so a few KB of `[[[[…` raise
RecursionError wherever it is read. These readers parse with the same bounded parser as the
wire's frames (pydantic-core's jiter, native code that refuses nesting deeper than MAX_DEPTH),
so any input either parses or raises ValueError. They also refuse what a frame refuses: NaN,
Infinity and lone surrogates (text that could not be sent on as UTF-8 JSON).
"""

from __future__ import annotations

import gc
import re
from typing import Any

from pydantic_core import from_json

MAX_DEPTH = 200
"""Deepest nesting of arrays and objects that parses (jiter's recursion limit; deeper is a ValueError)."""

MAX_BODY_VALUES = 32_768
"""Most JSON values (objects, arrays, strings, numbers, booleans, nulls; an object's keys count too) that a
request body may hold: as many as a 32,768-token context has tokens (every message, content part, token id or
schema key of a prompt costs at least one), and few enough that refusing the worst body allowed takes about
0.1 s (benchmarks/results/attacks/invalid-arrays). Validation holds the interpreter (pydantic's native code keeps
the GIL), and a 3 MB body of a million wrong-typed array items held the HTTP front for up to 16 s."""

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*+"?|[\[{]|[\]}]', re.DOTALL)
"""A string (possessive, unterminated ones to the end: linear time on any text) or a bracket."""


def loads(text: str | bytes) -> Any:
    """The JSON value in `text`; ValueError for anything else (invalid, too deep, trailing text, lone surrogates).

    The cyclic garbage collector is paused meanwhile: parsed JSON holds no cycles, and a body of a million small
    arrays set off full collections over the daemon's whole heap, 0.5 s of a 0.07 s parse with the GIL held."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return from_json(text.encode() if isinstance(text, str) else text, allow_inf_nan=False)
    finally:
        if enabled:
            gc.enable()


def count_values(value: Any, limit: int) -> int:
    """How many JSON values `value` holds (itself included, an object's keys counted), up to `limit + 1`: the
    count stops as soon as it passes `limit`, so the work is bounded by the limit, not by the value's size."""
    seen, stack = 0, [value]
    while stack:
        item = stack.pop()
        seen += 1
        if isinstance(item, dict):
            seen += len(item)
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if seen + len(children) > limit:
            return limit + 1
        stack.extend(children)
    return seen


def loads_objects(text: str) -> list[Any]:
    """The JSON objects in `text`, one after another with only whitespace around them; ValueError otherwise."""
    values, start, depth = [], 0, 0
    for token in _TOKEN.finditer(text):
        kind = token.group()
        if depth == 0:
            if kind != "{" or text[start:token.start()].strip():
                raise ValueError("expected JSON objects separated by whitespace")
            start = token.start()
        if kind in ("[", "{"):
            depth += 1
        elif kind in ("]", "}"):
            depth -= 1
            if depth == 0:
                values.append(loads(text[start:token.end()]))
                start = token.end()
    if depth != 0 or text[start:].strip():
        raise ValueError("expected JSON objects separated by whitespace")
    return values
