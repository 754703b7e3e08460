"""Hostile content through both doors of a tiny daemon subprocess (issue 33): nothing may take it down.

Hypothesis draws structure-aware hostile cases (tests/hostile/strategies.py), one run per family and
door: random JSON schemas, regexes, tool lists, message lists, options at their edges, malformed
frames, and the shapes known to have killed the daemon. Each case must be refused with a stable code
or served; after each case the daemon is alive and ready, and after each run (a batch of at most
50 cases) exact mode over both doors equals the target's own greedy output. A death or hang fails
the test naming the case (its whole body is written to a file next to the daemon's log); the next
test gets a fresh daemon. Derandomized, no shrinking (each shrink step could need a daemon
restart), no example database. On the tiny pair's 512-token window the `forced_deep` family cannot
force output deep enough to reach the parser's old RecursionError (finding 3 needs ~2,000 tokens).
Known killers on 5f419fe: `ref_chain` (a segfault), `deep_arguments` (the socket loop dies; HTTP
500 with the exception text), `empty_language` (served as an empty `stop`). The OpenAI door also gets
families of its own (issue 36): /tokenize and /detokenize bodies, `n`, `logprobs` / `top_logprobs` /
`echo`, and the embedding routes (issue 47: /v1/embeddings, and /api/embed and /api/embeddings judged in
Ollama's error shape), and issue 45's `n` × `echo` × `logprobs` amplification and forwarded-header spoofing
(the daemon trusts loopback as a proxy, so the headers are parsed); a served answer must hold all its choices
(indexed 0..n-1), a stream must finish each.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from hostile.doors import FuzzTarget, HttpDoor, ZmqDoor, run_case
from hostile.strategies import CI_EXAMPLES, FAMILIES, OPENAI_FAMILIES, Case

DOORS = {"zmq": ZmqDoor, "http": HttpDoor}


def fuzz(target: FuzzTarget, door: ZmqDoor | HttpDoor, family: str, examples: int) -> int:
    """Run `examples` cases of `family` through `door`, then check exact mode; return how many ran.

    Raises Finding on the first finding. The exact-mode check stays outside the hypothesis run: a check
    every n cases would not be repeated when hypothesis replays a failing case, which it calls flaky.
    """
    ran = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], print_blob=False, suppress_health_check=list(HealthCheck))
    @given(case=(FAMILIES | OPENAI_FAMILIES)[family])
    def one(case: Case) -> None:
        run_case(target, door, case, target.workdir / f"failing-{door.name}-{family}.json")
        ran.append(case)

    one()
    target.check_exact()
    return len(ran)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("door", list(DOORS))
def test_hostile_content_is_refused_or_served(fuzz_target, door, family):
    ran = fuzz(fuzz_target, DOORS[door](fuzz_target), family, CI_EXAMPLES[family])
    assert ran >= min(CI_EXAMPLES[family], 2)


@pytest.mark.parametrize("family", list(OPENAI_FAMILIES))
def test_hostile_openai_routes_and_fields_are_refused_or_served(fuzz_target, family):
    ran = fuzz(fuzz_target, HttpDoor(fuzz_target), family, CI_EXAMPLES[family])
    assert ran >= min(CI_EXAMPLES[family], 2)
