"""A body with a long array of wrong-typed items, on every door: refused as a 400 naming a few problems, while
the HTTP front keeps answering everyone else (issue 65). Before the bound, a 3 MB body of a million such items
held every client of the front for 3 to 16 s (benchmarks/results/attacks/invalid-arrays)."""

from __future__ import annotations

import pytest
from support.hostile_bodies import WRONG_ITEMS, refused
from support.http_double import double_front

from fly_llm.common.json_text import MAX_BODY_VALUES

HEALTH_BOUND = 1.0
"""Seconds /health may take while one body is refused: ten times the worst measured on 2 busy cores (0.11 s)."""


def problems(error: object) -> str:
    """The message of an error body (OpenAI's and Anthropic's an object, Ollama's the message itself)."""
    return error["message"] if isinstance(error, dict) else str(error)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    with double_front(tmp_path_factory.mktemp("bodies")) as (_, client):
        client.timeout = 60
        yield client


@pytest.mark.parametrize("door", list(WRONG_ITEMS))
def test_a_body_past_the_bound_is_refused_unvalidated(front, door):
    path, make = WRONG_ITEMS[door]
    refusal = refused(front, path, make(1_000_000))
    assert refusal.status == 400 and f"more than {MAX_BODY_VALUES} JSON values" in problems(refusal.error)
    assert refusal.health_longest < HEALTH_BOUND


@pytest.mark.parametrize("door", list(WRONG_ITEMS))
def test_the_worst_body_within_the_bound_is_refused_briefly_naming_a_few_problems(front, door):
    path, make = WRONG_ITEMS[door]
    refusal = refused(front, path, make(MAX_BODY_VALUES - 16))
    assert refusal.status == 400 and "JSON values" not in problems(refusal.error)
    assert 1 <= problems(refusal.error).count(": ") <= 5  # "field: problem" per named problem
    assert refusal.health_longest < HEALTH_BOUND
