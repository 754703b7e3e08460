"""Structure options to constraints, at the serving edge (no torch): the model's tool-call format,
the response_format mapping, and a cache of both.

A tool-call format (`ToolFormat`) owns its tags, the grammar that constrains its calls and the
parser that reads them back (`hermes.py`: Qwen's / Hermes'). A second format is one new module
plus a line in `FORMATS`; `format_for` picks one by the model's chat template. Only these modules
know a format's tags: the daemon's delivery (fly_daemon.scheduling.delivery) parses calls, and clients and
adapters see parsed calls (`ToolCall`, `UnparsedCall`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, Protocol

from fly_llm.common.constraints import Constraint
from fly_llm.common.errors import BadRequest
from fly_llm.common.lru import ENTRY_BYTES, LruCache, text_bytes
from fly_llm.common.schema_limits import SchemaCaps
from fly_llm.common.tool_formats.hermes import HERMES
from fly_llm.common.tools import Structure, ToolCall, UnparsedCall

CACHE_BYTES = 32 << 20
"""Bytes of structures' constraints kept for reuse (LRU), unless the engine says otherwise."""


class CallParser(Protocol):
    """Reads a model's tool calls out of its streamed text (`hermes.ToolCallStream`)."""

    unparsed: list[UnparsedCall]
    """The call blocks that stayed text so far (they did not parse, or were cut off)."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add a text delta; return (text to show now, calls completed by it)."""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """When the stream ends: the text still held back, and the calls found only then."""


class ToolFormat(Protocol):
    """How a model writes tool calls: the grammar that constrains them and the parser that finds them."""

    name: str
    tags: tuple[str, ...]
    """Strings that may be single special tokens of a tokenizer (`constraint`'s `special_tags` are among them)."""

    def constraint(self, structure: Structure, special_tags: frozenset[str], caps: SchemaCaps) -> Constraint:
        """The constraint of a request that offers tools; BadRequest for a schema over `caps`."""

    def written_by(self, chat_template: str) -> bool:
        """Whether a chat template asks the model for calls in this format."""

    def parser(self, structure: Structure) -> CallParser:
        """The streaming call parser of a request that may call tools."""


FORMATS: dict[str, ToolFormat] = {HERMES.name: HERMES}
"""The tool-call formats by name."""


def format_for(chat_template: str | None) -> ToolFormat:
    """The tool-call format a model's chat template asks for: the first of `FORMATS` it is written in,
    else Hermes (also for a model without a template)."""
    return next((f for f in FORMATS.values() if chat_template and f.written_by(chat_template)), HERMES)


def constraint_for(structure: Structure | None, tool_format: ToolFormat = HERMES,
                   special_tags: frozenset[str] = frozenset(), caps: SchemaCaps = SchemaCaps()) -> Constraint | None:
    """The constraint of a request's structure options; None when its output is free."""
    if structure is None or structure.is_free:
        return None
    if structure.tools:
        return tool_format.constraint(structure, special_tags, caps)
    fmt = structure.response_format
    if fmt.type == "regex":
        return Constraint("regex", fmt.pattern)
    return Constraint("json_schema", json.dumps(fmt.json_schema_ if fmt.type == "json_schema" else {"type": "object"}))


class Constraints:
    """A model's structures to constraints, remembered by content (a repeated tool list is neither
    rebuilt nor walked again). Thread-safe.

    `special_tokens(texts)`: which of `texts` are one special token each of the model's tokenizer
    (the engine's `GrammarCompiler.special_tokens`; asked once, when a structure first needs it).
    The constraints kept take at most `cache_bytes`.
    """

    def __init__(self, tool_format: ToolFormat, special_tokens: Callable[[tuple[str, ...]], frozenset[str]],
                 caps: SchemaCaps = SchemaCaps(), cache_bytes: int = CACHE_BYTES) -> None:
        self.tool_format = tool_format
        self.caps = caps
        self._special_tokens = special_tokens
        self._cache: LruCache[bytes, Constraint | None] = LruCache(cache_bytes, _constraint_bytes)

    @classmethod
    def of(cls, engine: Any) -> "Constraints":
        """The constraints for a loaded engine's model (a FLyEngine, not imported here: no torch), in the
        tool format its chat template asks for."""
        template = getattr(engine.tokenizer, "chat_template", None)  # text, named texts (a dict) or None
        tool_format = format_for(str(template) if template else None)
        grammars = engine.grammars
        return cls(tool_format, grammars.special_tokens, grammars.caps, grammars.texts_budget)

    def constraint(self, structure: Structure | None) -> Constraint | None:
        """The constraint of a request's structure (None: free output); BadRequest for a bad one."""
        if structure is None or structure.is_free:  # checked here too: special tokens build the tokenizer view
            return None
        try:
            text = structure.model_dump_json()
        except (ValueError, RecursionError) as exc:  # pydantic refuses data nested deeper than it can write
            raise BadRequest(f"the structure cannot be serialized: {exc}") from None
        return self._cache.get_or_make(hashlib.sha256(text.encode()).digest(), lambda: self._make(structure))

    def _make(self, structure: Structure) -> Constraint | None:
        special = self._special_tokens(self.tool_format.tags) if structure.tools else frozenset()
        return constraint_for(structure, self.tool_format, special, self.caps)

    def check(self) -> None:
        """Assert the cache's byte count and budget (`LruCache.check`)."""
        self._cache.check()


def _constraint_bytes(key: bytes, constraint: Constraint | None) -> int:
    texts = () if constraint is None else (constraint.text, *(t for part in constraint.parts for t in part))
    return ENTRY_BYTES + text_bytes(key, *texts)
