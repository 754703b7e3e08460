"""Hostile content through the Responses API (/v1/responses) and Anthropic's Messages API (/v1/messages,
/v1/messages/count_tokens) of a tiny daemon subprocess: nothing may take it down, and every refusal is a clear
4xx in the API's own error shape with a stable code.

The door-neutral families of tests/hostile/strategies.py, posted in each API's shape (tests/hostile/api_doors.py),
a few cases each (the grammar and decoding behind both APIs are the chat route's, fuzzed in full by
test_hostile_fuzz.py), and each API's own families (tests/hostile/api_strategies.py: input items, content blocks,
the stateful and unserved fields). After each case the daemon is alive and ready; after each family exact mode
over ZeroMQ and HTTP equals the target's own greedy output.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from hostile.api_doors import MessagesDoor, ResponsesDoor
from hostile.api_strategies import API_CI_EXAMPLES, API_FAMILIES
from hostile.doors import FuzzTarget, run_case
from hostile.strategies import CI_EXAMPLES, FAMILIES, Case

API_DOORS = {"responses": ResponsesDoor, "messages": MessagesDoor}
SHARED_EXAMPLES = 8
"""Cases per door-neutral family and API door in CI (fewer than the chat route's: the same engine path)."""


def fuzz(target: FuzzTarget, door: ResponsesDoor | MessagesDoor, family: str, examples: int) -> int:
    """Run `examples` cases of `family` through `door`, then check exact mode; return how many ran."""
    ran = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], print_blob=False, suppress_health_check=list(HealthCheck))
    @given(case=(FAMILIES | API_FAMILIES)[family])
    def one(case: Case) -> None:
        run_case(target, door, case, target.workdir / f"failing-{door.name}-{family}.json")
        ran.append(case)

    one()
    target.ensure_running()
    target.check_exact()
    return len(ran)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("door", list(API_DOORS))
def test_hostile_content_is_refused_or_served(fuzz_target, door, family):
    examples = min(CI_EXAMPLES[family], SHARED_EXAMPLES)
    assert fuzz(fuzz_target, API_DOORS[door](fuzz_target), family, examples) >= min(examples, 2)


@pytest.mark.parametrize("family", list(API_FAMILIES))
def test_hostile_bodies_of_each_api_are_refused_or_served(fuzz_target, family):
    door = API_DOORS["responses" if family.startswith("responses") else "messages"](fuzz_target)
    assert fuzz(fuzz_target, door, family, API_CI_EXAMPLES[family]) >= 2
