"""Structures as the daemon constrains them, for engine tests: `schema_structure`, `constraint_of`."""

from __future__ import annotations

from fly_llm.common.constraints import Constraint
from fly_llm.common.tool_formats import Constraints
from fly_llm.common.tools import Structure


def schema_structure(schema: dict) -> Structure:
    """A structure asking for JSON valid under `schema`."""
    return Structure(response_format={"type": "json_schema", "schema": schema})


def constraint_of(eng, structure: Structure | None) -> Constraint | None:
    """The constraint the scheduler would give `eng` for `structure` (its tool format, special tokens, caps)."""
    return Constraints.of(eng).constraint(structure)
