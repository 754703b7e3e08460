"""What the engine compiles to constrain a request's output: a `Constraint`, plain data (no torch).

The serving edge (fly_llm.common.tool_formats) turns a request's structure options into one; the engine
(fly_llm.decoding.grammar) compiles it into a matcher and knows nothing about tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from fly_llm.common.errors import BadRequest

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How generated JSON is laid out: Python's json.dumps style, so separators are forced tokens."""


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint: a grammar of a kind.

    `kind`: "grammar" (llguidance's Lark syntax, `text` as it is), "regex" (`text` is the pattern,
    anchored at both ends) or "json_schema" (`text` is the schema as JSON; the engine checks it
    against its caps). `parts`: `(what, schema JSON)` for the schemas a grammar was built from:
    when the whole does not compile, the first part that fails on its own is named in the error.
    """

    kind: Literal["grammar", "regex", "json_schema"]
    text: str
    parts: tuple[tuple[str, str], ...] = ()


def json_lexeme(schema: dict) -> str:
    """An inline JSON Schema lexeme of a Lark grammar, with our JSON layout (`JSON_STYLE`)."""
    if not isinstance(schema, dict):
        raise BadRequest("a JSON Schema must be an object")
    styled = {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(styled)
