"""Self-healing: a step that fails mid-round leaves a clean engine, in process and inside a daemon.

`FaultyEngine` is the real FLyEngine with a seeded chance that a round fails after drafting
and inside verification (caches half-advanced, the worst moment). After each failure the engine
must be empty and consistent, and every later request must still get the target's own greedy
output (exact mode, float32).
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fly_llm.client import FLyClient, build_options
from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.common.errors import Internal

from fly_daemon.core import ServingCore
from fly_daemon.scheduling.scheduler import Limits
from fly_daemon.server import Server
from support.tiny_models import greedy_tokens, make_pair

torch.set_num_threads(1)

PROMPTS = ["def add(a, b):", "x", "The quick brown fox", "for i in range(10):\n    print(", "Q", "class Stack:"]
MAX_NEW = 12


class InjectedFault(RuntimeError):
    """The failure FaultyEngine raises."""


class FaultyEngine(FLyEngine):
    """FLyEngine whose target forward fails with probability `rate` (seeded), while `armed` is set."""

    def __init__(self, *args, rate: float, seed: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rate, self.rng, self.armed, self.failures = rate, random.Random(seed), True, 0

    def _verify(self, *args, **kwargs):
        zeros = torch.tensor([[0]] * self._kv.batch_size, device=self.device)
        self._kv.forward(self.target, zeros)  # advance the cache first
        if self.armed and self.rng.random() < self.rate:
            self.failures += 1
            raise InjectedFault("injected step failure")
        self._kv.truncate([n - 1 for n in self._kv.lengths])
        return super()._verify(*args, **kwargs)


@pytest.fixture(scope="module")
def pair_and_reference():
    target, draft, tokenizer = make_pair("llama")
    reference = {}
    for prompt in PROMPTS:
        reference[prompt] = greedy_tokens(target, tokenizer.encode(prompt), MAX_NEW, [tokenizer.eos_token_id])
    return (target, draft, tokenizer), reference


def test_failed_rounds_reset_the_engine_and_service_continues(pair_and_reference):
    (target, draft, tokenizer), reference = pair_and_reference
    engine = FaultyEngine(target, tokenizer, draft, FLyConfig(loose=False), rate=0.3, seed=1)
    sampling = SamplingParams(max_tokens=MAX_NEW)
    done: dict[str, list[int]] = {}
    for wave in range(6):
        ids = [f"w{wave}-{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(ids, PROMPTS):
            engine.add_request(rid, engine.encode(prompt), sampling)
        tokens = {rid: [] for rid in ids}
        while engine.has_unfinished():
            try:
                outputs = engine.step()
            except InjectedFault:
                assert not engine.has_unfinished() and engine.reset() == []
                assert not any(engine.abort_request(rid) for rid in ids)  # aborting after a failed step is safe
                break
            finally:
                engine.check()
            for out in outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    done[out.request_id] = tokens[out.request_id]
    assert engine.failures >= 2, "the fault never fired: the test shows nothing"
    engine.armed = False
    gens = engine.generate(PROMPTS, sampling, FLyConfig(loose=False))
    assert [g.token_ids for g in gens] == [reference[p] for p in PROMPTS]
    for rid, tokens in done.items():
        assert tokens == reference[PROMPTS[int(rid.split("-")[1])]]


def test_daemon_survives_random_step_failures(pair_and_reference, tmp_path):
    (target, draft, tokenizer), reference = pair_and_reference
    engine = FaultyEngine(target, tokenizer, draft, FLyConfig(loose=False), rate=0.15, seed=2)
    endpoint = f"ipc://{tmp_path}/f.sock"
    server = Server(endpoint, ServingCore(lambda: engine, Limits(heartbeat_timeout=0)))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    sampling, fly = build_options(max_tokens=MAX_NEW, loose=False)
    answers, failures = 0, 0
    try:
        with FLyClient(endpoint, timeout=30, max_retries=0) as client, ThreadPoolExecutor(len(PROMPTS)) as pool:
            for _ in range(5):
                for prompt, outcome in zip(PROMPTS, pool.map(lambda p: _generate(client, p, sampling, fly), PROMPTS)):
                    if isinstance(outcome, Internal):
                        assert "engine step failed" in str(outcome) and "injected" not in str(outcome)  # ours only
                        failures += 1
                    else:
                        assert outcome == reference[prompt], prompt
                        answers += 1
            engine.armed = False
            for prompt in PROMPTS:
                assert _generate(client, prompt, sampling, fly) == reference[prompt]
            assert client.health().state == "ready"
    finally:
        server.request_stop()
        thread.join(15)
    assert failures >= 1 and answers >= 1, (failures, answers)


def _generate(client: FLyClient, prompt: str, sampling, fly) -> list[int] | Internal:
    try:
        return client.generate(prompt, sampling, fly).token_ids
    except Internal as exc:
        return exc


def test_a_failure_outside_a_step_fails_everything_and_the_daemon_exits_nonzero(pair_and_reference, tmp_path):
    (target, draft, tokenizer), _ = pair_and_reference
    engine = FaultyEngine(target, tokenizer, draft, FLyConfig(loose=False), rate=0.0, seed=0)
    endpoint = f"ipc://{tmp_path}/m.sock"
    server = Server(endpoint, ServingCore(lambda: engine))
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(server.serve()), daemon=True)
    thread.start()
    with FLyClient(endpoint, timeout=30, max_retries=0) as client:
        assert client.generate("x", *build_options(max_tokens=2)).usage.completion_tokens >= 1

        def broken() -> bool:
            if not engine.num_active:  # break only once the request is in: else it may arrive after the failure
                return False
            raise InjectedFault("the loop itself broke")

        engine.has_unfinished = broken
        with pytest.raises(Internal, match="the model thread failed") as caught:
            client.generate("x", *build_options(max_tokens=2))
        assert "the loop itself broke" not in str(caught.value)  # the exception's text stays in the log
    thread.join(15)
    assert exit_code == [1] and server.scheduler.state == "failed"
    assert "the loop itself broke" not in server.scheduler.detail
