"""A row's fault is the row's (issue 45): a per-row stage that raises ends that request alone.

A batch of mixed rows (greedy, seeded sampling, log-probabilities, a JSON Schema) plus one *victim* row
whose stage is made to raise — sampling, its penalties, the grammar matcher (as a Rust panic: a BaseException), the
log-probabilities, the detokenizer. The victim ends with the stage's stable code and a message of ours;
every other row's tokens equal its solo run (exact mode, float32) and the engine's invariants hold
after every step. Then the same requests run again, unfaulted, to the same tokens.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fly_llm.client import FLyClient, build_options
from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.common.errors import Internal
from fly_llm.decoding import engine as engine_module
from fly_llm.decoding import verify as verify_module
from fly_llm.decoding.engine import FLyEngine
from fly_llm.decoding.penalties import Penalty
from fly_llm.decoding.stages.grammar import GrammarStage
from fly_llm.decoding.text import Detokenizer
from support.structures import constraint_of, schema_structure
from support.tiny_models import make_pair

from fly_daemon.core import ServingCore
from fly_daemon.scheduling.scheduler import Limits
from fly_daemon.server import Server

torch.set_num_threads(1)

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
ROWS = {  # request id: (prompt, sampling, logprobs, constrained)
    "greedy": ("def add(a, b):", SamplingParams(max_tokens=16), None, False),
    "sampled": ("The quick brown fox", SamplingParams(max_tokens=16, temperature=0.8, seed=5), None, False),
    "logprobs": ("for i in range(10):", SamplingParams(max_tokens=16), 1, False),
    "json": ("Question: what is 2 + 3?", SamplingParams(max_tokens=40), None, True),
}
VICTIM_TEMPERATURE = 0.77
"""The victim's temperature: the injected sampling fault fires for the rows that have it."""
VICTIM_PENALTY = 1.77
"""The victim's repetition_penalty: the injected penalty fault fires for the rows that have it."""
VICTIM_LOGPROBS = 3
"""The victim asks for this many alternatives: the injected log-probability fault fires for it only."""


class PanicException(BaseException):
    """Named like pyo3's: what llguidance raises when its Rust code panics."""


@pytest.fixture(scope="module")
def pair():
    return make_pair("llama")


def _engine(pair) -> FLyEngine:
    target, draft, tokenizer = pair
    return FLyEngine(target, tokenizer, draft, FLyConfig(loose=False))


def _add(eng: FLyEngine, rid: str, prompt: str, sampling: SamplingParams, logprobs: int | None, constrained: bool):
    constraint = constraint_of(eng, schema_structure(SCHEMA)) if constrained else None
    eng.add_request(rid, eng.encode(prompt), sampling, constraint=constraint, logprobs=logprobs)


def _run(eng: FLyEngine) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Step until done: per request, its tokens and its error's code and message (None, None when it succeeded)."""
    results: dict[str, tuple[list[int], str | None, str | None]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            eng.check()
            tokens = results.get(out.request_id, ([], None, None))[0] + out.new_token_ids
            results[out.request_id] = (tokens, out.error_code if out.error else None, out.error)
    return results


@pytest.fixture(scope="module")
def solo(pair) -> dict[str, list[int]]:
    """Each row's tokens when it runs alone."""
    out = {}
    for rid, row in ROWS.items():
        eng = _engine(pair)
        _add(eng, rid, *row)
        (tokens, code, _), = _run(eng).values()
        assert code is None
        out[rid] = tokens
    return out


def _fault_sampling(monkeypatch, eng):
    real = verify_module.distributions

    def distributions(logits, temperatures, top_ps, *filters):
        if any(abs(t - VICTIM_TEMPERATURE) < 1e-6 for t in temperatures):
            raise FloatingPointError("injected sampling fault")
        return real(logits, temperatures, top_ps, *filters)

    monkeypatch.setattr(verify_module, "distributions", distributions)
    return SamplingParams(max_tokens=16, temperature=VICTIM_TEMPERATURE, seed=1), None, False


def _fault_penalties(monkeypatch, eng):
    real = Penalty.apply_

    def apply_(penalty, logits, context, drafts):
        if penalty.repetition == VICTIM_PENALTY:
            raise FloatingPointError("injected penalty fault")
        return real(penalty, logits, context, drafts)

    monkeypatch.setattr(Penalty, "apply_", apply_)
    return SamplingParams(max_tokens=16, repetition_penalty=VICTIM_PENALTY), None, False


def _fault_logprobs(monkeypatch, eng):
    real = engine_module.token_logprobs

    def token_logprobs(logits, tokens, top):
        if top == VICTIM_LOGPROBS:
            raise IndexError("injected log-probability fault")
        return real(logits, tokens, top)

    monkeypatch.setattr(engine_module, "token_logprobs", token_logprobs)
    return SamplingParams(max_tokens=16), VICTIM_LOGPROBS, False


def _fault_detokenizing(monkeypatch, eng):
    real = Detokenizer.add
    victims: list[Detokenizer] = []

    def add(self, token_ids):
        if any(self is victim for victim in victims):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real(self, token_ids)

    monkeypatch.setattr(Detokenizer, "add", add)
    monkeypatch.setattr(eng, "add_request", _recording(eng.add_request, lambda: victims.append(eng._waiting[-1].detok)))
    return SamplingParams(max_tokens=16), None, False


def _grammar_fault(method: str):
    """A fault of the victim's grammar matcher in one of the grammar stage's per-row calls, as a panic."""
    def inject(monkeypatch, eng):
        victims: list[object] = []
        real = getattr(GrammarStage, method)

        def faulty(*args):
            matcher = args[0].rows[args[1]] if method == "_forced" else args[0]  # (stage, row, …) or (matcher, …)
            if any(matcher is victim for victim in victims):
                raise PanicException("panicked at /home/runner/.cargo/registry/src/parser.rs:12:5")
            return real(*args)

        monkeypatch.setattr(GrammarStage, method, faulty if method == "_forced" else staticmethod(faulty))
        monkeypatch.setattr(eng, "add_request",
                            _recording(eng.add_request, lambda: victims.append(eng._waiting[-1].matcher)))
        return SamplingParams(max_tokens=40), None, True
    return inject


def _recording(add_request, record):
    """`add_request` that calls `record()` after adding the victim (the last request added)."""
    def add(request_id, *args, **kwargs):
        add_request(request_id, *args, **kwargs)
        if request_id == "victim":
            record()
    return add


FAULTS = {
    "sampling": (_fault_sampling, "INTERNAL"),
    "penalties": (_fault_penalties, "INTERNAL"),
    "log-probabilities": (_fault_logprobs, "INTERNAL"),
    "detokenizing": (_fault_detokenizing, "INTERNAL"),
    "grammar-forced-tokens": (_grammar_fault("_forced"), "BAD_REQUEST"),
    "grammar-masks": (_grammar_fault("_fill"), "BAD_REQUEST"),
    "grammar-observe": (_grammar_fault("_feed"), "BAD_REQUEST"),
}


@pytest.mark.parametrize("stage", list(FAULTS))
def test_a_faulty_row_ends_alone(pair, solo, monkeypatch, stage):
    inject, code = FAULTS[stage]
    eng = _engine(pair)
    victim = inject(monkeypatch, eng)
    for position, (rid, row) in enumerate(ROWS.items()):
        if position == 2:  # the victim in the middle of the batch
            _add(eng, "victim", "class Stack:", *victim)
        _add(eng, rid, *row)
    results = _run(eng)
    tokens, error_code, message = results.pop("victim")
    assert error_code == code, (stage, results)
    assert "injected" not in message and "/home/" not in message and "\n" not in message, message
    assert {rid: r for rid, r in results.items()} == {rid: (solo[rid], None, None) for rid in ROWS}
    monkeypatch.undo()
    for rid, row in ROWS.items():  # the engine is clean: the same requests again, unfaulted
        _add(eng, rid, *row)
    assert _run(eng) == {rid: (solo[rid], None, None) for rid in ROWS}


def test_a_row_fault_reaches_its_client_alone(pair, solo, monkeypatch, tmp_path):
    """Through the daemon: the victim gets INTERNAL with our message, the others their solo tokens."""
    target, draft, tokenizer = pair
    eng = FLyEngine(target, tokenizer, draft, FLyConfig(loose=False))
    victim_sampling, _, _ = _fault_sampling(monkeypatch, eng)
    endpoint = f"ipc://{tmp_path}/rf.sock"
    server = Server(endpoint, ServingCore(lambda: eng, Limits(heartbeat_timeout=0)))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        with FLyClient(endpoint, timeout=60, max_retries=0) as client:
            rids = ["greedy", "sampled"]
            requests = [(ROWS[rid][0], ROWS[rid][1]) for rid in rids] + [("class Stack:", victim_sampling)]
            outcomes: list = [None] * len(requests)

            def call(i: int) -> None:
                prompt, sampling = requests[i]
                try:
                    outcomes[i] = client.generate(prompt, sampling, build_options(loose=False)[1]).token_ids
                except Internal as exc:
                    outcomes[i] = exc

            threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert outcomes[:2] == [solo[rid] for rid in rids]
            assert isinstance(outcomes[2], Internal) and "sampling stage" in outcomes[2].message
            assert "injected" not in outcomes[2].message
    finally:
        server.request_stop()
        thread.join(15)
