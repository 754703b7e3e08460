"""Seeded random traffic through a real daemon subprocess (tiny float32 pair): nothing breaks it.

Bursts of concurrent requests arrive with idle gaps between them, some long enough that the batch
drains to empty: prompts of one token, of a few, of hundreds, and over the context window; plain
and streamed requests; streams cancelled after their first chunk; clients that give up (short
timeouts); a client process killed mid-stream; FLy-mode sampled requests; seeded exact-mode sampled
requests; BUSY from a small queue. Every exact-mode greedy answer must equal the target's own greedy output
for that prompt alone, every seeded exact-mode one the same request sampled alone with plain decoding
(docs/design.md §1.3); at the end the daemon is alive, idle, healthy, logged no traceback, and still answers
correctly.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from support.daemon_process import start_daemon
from support.device import TEST_DEVICE
from fly_llm.client import FLyClient, build_options
from fly_llm.common.errors import Busy, FLyUnavailable, Timeout, TooLong
from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.common.protocol import GenerateResult
from fly_llm.decoding.engine import FLyEngine
from fly_llm.model.quantization import quantization_of, quantize
from support.tiny_models import CORPUS, greedy_tokens

MAX_NEW = 16
SAMPLED_TEMPERATURE = 0.9
BURSTS = 30
WORDS = " ".join(CORPUS).split(" ")
ONE_TOKEN = ["x", "Q", "a", "5", "(", "\n", "The"]


@pytest.fixture(scope="module")
def traffic_daemon(tiny_pair_dirs, tmp_path_factory):
    """A daemon with a small batch and queue, so bursts overflow it; its process and log stay readable.

    Its target runs as a CPU user's does by default (w4a8 on AVX-512 VNNI CPUs, else int8 where torch has the kernels)."""
    daemon = start_daemon(*tiny_pair_dirs, tmp_path_factory.mktemp("traffic"), "t", "--max-batch-size", "4",
                          "--queue-size", "6", "--heartbeat-timeout", "2", "--target-quantization", "auto")
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def greedy(tiny_pair_dirs):
    """greedy(prompt) -> the target's own greedy continuation (MAX_NEW tokens, cut after EOS), float32, alone,
    with the daemon's weights (quantized as 'auto' chooses)."""
    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dirs[0], dtype=torch.float32).eval()
    quantize(target, "auto", torch.device(TEST_DEVICE))
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair_dirs[0])

    @lru_cache(maxsize=None)
    def run(prompt: str) -> list[int]:
        return greedy_tokens(target, tokenizer.encode(prompt), MAX_NEW, [tokenizer.eos_token_id])

    alone, one_at_a_time = FLyEngine(target, tokenizer, None, FLyConfig(stages=())), threading.Lock()

    @lru_cache(maxsize=None)
    def sampled(prompt: str, max_tokens: int, seed: int) -> list[int]:
        """The request sampled alone, with plain decoding (temperature SAMPLED_TEMPERATURE)."""
        with one_at_a_time:  # the calls run in threads
            alone.add_request("alone", tokenizer.encode(prompt),
                              SamplingParams(max_tokens=max_tokens, temperature=SAMPLED_TEMPERATURE, seed=seed))
            tokens = []
            while alone.has_unfinished():
                tokens += [t for out in alone.step() for t in out.new_token_ids]
            return tokens

    run.token_count = lambda prompt: len(tokenizer.encode(prompt))
    run.target = target
    run.sampled = sampled
    return run


@dataclass(frozen=True)
class Call:
    """One request of the traffic: what kind, its prompt and options."""

    kind: str  # generate | stream | cancel | give_up | sampled | seeded | too_long
    prompt: str
    max_tokens: int
    k: int


def random_prompt(rng: random.Random) -> str:
    shape = rng.random()
    if shape < 0.3:
        return rng.choice(ONE_TOKEN)
    start = rng.randrange(len(WORDS))
    count = rng.randint(2, 12) if shape < 0.8 else rng.randint(60, 140)
    return " ".join((WORDS * 30)[start:start + count])


def schedule(seed: int) -> list[tuple[list[Call], float]]:
    """Bursts of calls, each followed by an idle gap in seconds (< 0: wait until the batch drained)."""
    rng = random.Random(seed)
    kinds = ["generate"] * 5 + ["stream"] * 3 + ["cancel", "give_up", "sampled", "seeded"]
    bursts = []
    for _ in range(BURSTS):
        calls = [Call(rng.choice(kinds), random_prompt(rng), rng.randint(1, MAX_NEW), rng.choice([1, 4, 8, 15]))
                 for _ in range(rng.choice([1, 1, 2, 3, 6, 10]))]
        if rng.random() < 0.15:
            calls.append(Call("too_long", "def add(a, b): " * 600, 4, 4))
        bursts.append((calls, rng.choice([0.0, 0.02, 0.2, -1.0])))
    return bursts


def run_call(client: FLyClient, endpoint: str, call: Call, greedy) -> str:
    """Send one call and check what came back; return its outcome's name."""
    sampling, fly = build_options(max_tokens=call.max_tokens, loose=False, k=call.k)
    expected = greedy(call.prompt)[:call.max_tokens] if call.kind in ("generate", "stream") else None
    try:
        if call.kind == "generate":
            assert client.generate(call.prompt, sampling, fly).token_ids == expected, call
        elif call.kind == "stream":
            events = list(client.stream(call.prompt, sampling=sampling, fly=fly))
            final = events[-1]
            assert isinstance(final, GenerateResult) and final.token_ids == expected, call
            assert "".join(e.text for e in events[:-1]) == final.text
        elif call.kind == "cancel":
            stream = client.stream(call.prompt, sampling=build_options(max_tokens=MAX_NEW)[0], fly=fly)
            next(stream)
            stream.close()
        elif call.kind == "give_up":
            with FLyClient(endpoint, timeout=0.01, max_retries=0) as impatient:
                try:
                    impatient.generate(call.prompt, sampling, fly)
                except (Timeout, FLyUnavailable):
                    return "gave_up"
        elif call.kind == "sampled":
            sampling, fly = build_options(max_tokens=call.max_tokens, temperature=0.9, seed=call.k, k=call.k)
            assert client.generate(call.prompt, sampling, fly).usage.completion_tokens >= 1
        elif call.kind == "seeded":
            seed = call.k * 1000 + len(call.prompt)
            sampling, fly = build_options(max_tokens=call.max_tokens, temperature=SAMPLED_TEMPERATURE, seed=seed,
                                          loose=False, k=call.k)
            assert client.generate(call.prompt, sampling, fly).token_ids == greedy.sampled(
                call.prompt, call.max_tokens, seed), call
        elif call.kind == "too_long":
            with pytest.raises(TooLong):
                client.generate(call.prompt, sampling, fly)
    except Busy:
        return "busy"
    return call.kind


def kill_a_streaming_client(endpoint: str) -> None:
    """Start a client process that streams a long answer, and SIGKILL it after its first chunk."""
    script = ("from fly_llm.client import FLyClient, build_options\n"
              f"s, f = build_options(max_tokens={MAX_NEW}, loose=False, k=1)\n"
              f"for chunk in FLyClient({endpoint!r}, timeout=60).stream('The quick brown fox', sampling=s, fly=f):\n"
              "    print('chunk', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    proc.kill()
    proc.wait()


def wait_idle(client: FLyClient, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.status()
        if status.active == 0 and status.queue_depth == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the daemon did not become idle: {client.status()}")


@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_never_breaks_the_daemon(traffic_daemon, greedy, seed):
    endpoint, started = traffic_daemon.endpoint, time.monotonic()
    with FLyClient(endpoint) as client:
        info = client.info()
    assert info.target_quantization == quantization_of(greedy.target)  # the reference runs the same weights
    outcomes: dict[str, int] = {}
    with FLyClient(endpoint, timeout=60, max_retries=0) as client, ThreadPoolExecutor(16) as pool:
        pending: list[Future] = []
        for i, (calls, gap) in enumerate(schedule(seed)):
            pending += [pool.submit(run_call, client, endpoint, call, greedy) for call in calls]
            if i == BURSTS // 2:
                kill_a_streaming_client(endpoint)
            if gap < 0:
                for future in pending:
                    outcomes[future.result()] = outcomes.get(future.result(), 0) + 1
                pending = []
                wait_idle(client)
            else:
                time.sleep(gap)
        for future in pending:
            outcomes[future.result()] = outcomes.get(future.result(), 0) + 1
        wait_idle(client)
        assert client.health().state == "ready"
        assert client.generate("x", *build_options(max_tokens=MAX_NEW, loose=False)).token_ids == greedy("x")
    assert traffic_daemon.proc.poll() is None, traffic_daemon.output()
    assert "Traceback" not in traffic_daemon.output(), traffic_daemon.output()
    assert outcomes.get("generate", 0) + outcomes.get("stream", 0) >= 10, outcomes
    assert time.monotonic() - started < 60, outcomes
    print(f"seed {seed}: {outcomes} in {time.monotonic() - started:.1f} s")
