"""Untrusted JSON Schemas before any compiler sees them (docs/design.md §1.5).

- `check_schema(schema, caps)`: one walk over a schema (its `$ref`s followed, each subschema once)
  that raises BadRequest naming the first cap it exceeds: subschemas, `$defs` entries, nesting
  depth (a `$ref` followed counts as a level: a long chain of references is deep), enum values,
  properties of one object. The walk's own recursion is bounded by the depth cap.
- `hoist_defs(schema, prefix)`: a tool's parameters made fit to sit inside a bigger schema: their
  `$defs` / `definitions` (renamed `<prefix>:<name>`) to hoist to the root, and their local `$ref`s
  rewritten to point there (`#` itself too, for a schema that recurses through its root).
- `loosened(schema)`: the schema without the keywords the grammar engine (llguidance) does not implement
  (`UNIMPLEMENTED`): it accepts every value the schema accepts, and more.

Only keywords whose values are schemas are walked; `const`, `enum`, `default` and `examples` are
data, never rewritten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import unquote

from fly_llm.common.errors import BadRequest

SCHEMA_KEYS = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
"""Keywords whose value is one schema."""
LIST_KEYS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
"""Keywords whose value is a list of schemas."""
MAP_KEYS = ("properties", "patternProperties", "dependentSchemas")
"""Keywords whose value maps names to schemas (definitions aside)."""
DEFS_KEYS = ("$defs", "definitions")
"""Keywords that hold named schemas for `$ref`s."""
UNIMPLEMENTED = ("propertyNames", "dependentRequired", "dependentSchemas", "if", "then", "else", "contains",
                 "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "not", "uniqueItems")
"""Keywords llguidance 1.x refuses to compile ("Unimplemented keys"); each only restricts what a schema accepts."""


@dataclass(frozen=True)
class SchemaCaps:
    """Bounds on one request's schema; each far above what real applications send (a pydantic model,
    OpenAI's structured-output limits: 5,000 properties, 10 levels of nesting, 1,000 enum values)."""

    nodes: int = 10_000
    """subschemas in all"""
    defs: int = 1_000
    """`$defs` / `definitions` entries in all"""
    depth: int = 128
    """nesting depth, each `$ref` followed counting as one level"""
    enum: int = 10_000
    """values of one `enum`"""
    properties: int = 1_000
    """properties of one object"""


def check_schema(schema: object, caps: SchemaCaps = SchemaCaps()) -> None:
    """Raise BadRequest naming the first cap of `caps` that `schema` exceeds."""
    _Walk(schema, caps).run()


def subschemas(node: dict) -> Iterator[object]:
    """The schemas directly inside `node`, definitions aside (they are reached through `$ref`s)."""
    for key in SCHEMA_KEYS:
        value = node.get(key)
        if isinstance(value, dict):
            yield value
    for key in LIST_KEYS:
        value = node.get(key)
        if isinstance(value, list):
            yield from value
    for key in MAP_KEYS:
        value = node.get(key)
        if isinstance(value, dict):
            yield from value.values()


def with_subschemas(node: dict, change: Callable[[object], object], defs: bool = True) -> dict:
    """A copy of `node` with `change` applied to each schema directly inside it (its definitions too, if `defs`)."""
    out = dict(node)
    for key in SCHEMA_KEYS:
        if isinstance(node.get(key), dict):
            out[key] = change(node[key])
    for key in LIST_KEYS:
        if isinstance(node.get(key), list):
            out[key] = [change(value) for value in node[key]]
    for key in MAP_KEYS + (DEFS_KEYS if defs else ()):
        if isinstance(node.get(key), dict):
            out[key] = {name: change(value) for name, value in node[key].items()}
    return out


def loosened(schema: object) -> object:
    """`schema` without the UNIMPLEMENTED keywords, at any depth (definitions included): a schema the grammar
    engine compiles that accepts every value `schema` accepts. Walk it with `check_schema` first (its depth)."""
    if not isinstance(schema, dict):
        return schema
    return with_subschemas({key: value for key, value in schema.items() if key not in UNIMPLEMENTED}, loosened)


def definitions(node: dict) -> Iterator[tuple[str, str, object]]:
    """`(keyword, name, schema)` of every definition `node` holds."""
    for key in DEFS_KEYS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, schema in value.items():
                yield key, name, schema


def resolve(root: object, ref: str) -> object | None:
    """The schema a local `$ref` (`#` and a JSON Pointer) names inside `root`; None if it names none."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _Walk:
    """One pass over a schema: every subschema once (memoized by identity), `$ref`s followed."""

    def __init__(self, root: object, caps: SchemaCaps) -> None:
        self.root, self.caps = root, caps
        self.height: dict[int, int] = {}  # id(subschema) -> levels at and below it
        self.open: set[int] = set()  # subschemas on the current path (a `$ref` back to one ends there)
        self.defs: list[object] = []  # definitions found, to walk as roots too
        self.nodes = self.defs_seen = 0

    def run(self) -> None:
        self.visit(self.root, 0)
        while self.defs:  # a definition nothing refers to is compiled on its own: walked as a root
            self.visit(self.defs.pop(), 0)

    def visit(self, node: object, level: int) -> int:
        """The height of `node`'s subtree (references followed); raises at the first cap exceeded."""
        if not isinstance(node, dict):
            return 0
        key = id(node)
        if key in self.open:
            return 0
        height = self.height.get(key)
        if height is None:
            self._count(node, level + 1)
            self.open.add(key)
            below = [self.visit(child, level + 1) for child in subschemas(node)]
            ref = node.get("$ref")
            if isinstance(ref, str):
                below.append(self.visit(resolve(self.root, ref), level + 1))
            self.open.discard(key)
            height = self.height[key] = 1 + max(below, default=0)
        if level + height > self.caps.depth:
            _exceeded(f"nesting depth (each $ref followed counts as a level) over {self.caps.depth}")
        return height

    def _count(self, node: dict, level: int) -> None:
        """Count one new subschema and check its own caps."""
        caps = self.caps
        if level > caps.depth:
            _exceeded(f"nesting depth (each $ref followed counts as a level) over {caps.depth}")
        self.nodes += 1
        if self.nodes > caps.nodes:
            _exceeded(f"more than {caps.nodes} subschemas")
        found = [schema for _, _, schema in definitions(node)]
        self.defs.extend(found)
        self.defs_seen += len(found)
        if self.defs_seen > caps.defs:
            _exceeded(f"more than {caps.defs} $defs / definitions")
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > caps.enum:
            _exceeded(f"an enum of more than {caps.enum} values")
        properties = node.get("properties")
        if isinstance(properties, dict) and len(properties) > caps.properties:
            _exceeded(f"an object of more than {caps.properties} properties")


def _exceeded(what: str) -> None:
    raise BadRequest(f"the JSON Schema is too large for this server: {what}")


def hoist_defs(schema: object, prefix: str) -> tuple[object, dict[str, object]]:
    """`schema` without its definitions and with its local `$ref`s rewritten, and the definitions to
    hoist to the root of the schema it will sit in (`$defs`, names prefixed with `prefix`).

    A `$ref` into the definitions (`#/$defs/Name…`, `#/definitions/Name…`) points at the hoisted
    name; any other local `$ref` (`#`, `#/properties/…`) at the whole schema, hoisted as `prefix`.
    A schema with neither comes back unchanged (no definitions hoisted).
    """
    if not isinstance(schema, dict):
        return schema, {}
    hoisted: dict[str, object] = {}
    refers_to_root = False

    def target(ref: str) -> str:
        nonlocal refers_to_root
        if not ref.startswith("#"):
            return ref  # not local: left to the compiler (which refuses it)
        parts = ref[1:].split("/", 3)  # '', keyword, name, rest
        if len(parts) >= 3 and parts[0] == "" and parts[1] in DEFS_KEYS:
            return "#/$defs/" + _escape(prefix + ":" + _unescape(parts[2])) + "".join("/" + p for p in parts[3:])
        refers_to_root = True
        return "#/$defs/" + _escape(prefix) + ref[1:]

    def rewrite(node: object) -> object:
        if not isinstance(node, dict):
            return node
        out = with_subschemas(node, rewrite, defs=node is not schema)
        if node is schema:
            for key in DEFS_KEYS:
                out.pop(key, None)
        if isinstance(node.get("$ref"), str):
            out["$ref"] = target(node["$ref"])
        return out

    body = rewrite(schema)
    for _, name, definition in definitions(schema):
        hoisted[prefix + ":" + name] = rewrite(definition)
    if refers_to_root:
        hoisted[prefix] = body
    if not hoisted:
        return schema, {}
    return ({"$ref": "#/$defs/" + _escape(prefix)} if refers_to_root else body), hoisted


def _escape(name: str) -> str:
    """`name` as one JSON Pointer segment."""
    return name.replace("~", "~0").replace("/", "~1")


def _unescape(segment: str) -> str:
    return unquote(segment).replace("~1", "/").replace("~0", "~")
