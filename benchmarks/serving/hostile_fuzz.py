"""The hostile-content fuzzer run long (issue 33): thousands of cases through every door, counted.

    python benchmarks/serving/hostile_fuzz.py --examples 4000 --seed 0 --out benchmarks/results/hostile-fuzz

The same strategies, doors and rules as tests/hostile (a tiny random pair in a daemon subprocess,
ZeroMQ raw frames and HTTP bodies; the Responses and Messages APIs' doors, tests/hostile/api_doors.py, also
get their own families): `--examples` cases per door, split over the families in the proportions of the CI
run. Unlike the test, a finding does not stop the run: it is counted (crash,
hang, bad answer: a code outside the stable ones, an HTTP 5xx, a served empty language), its first
case per family is kept (shortened), and the daemon is restarted. Exact mode is checked against the
target's greedy output every `--check-every` cases. Writes counts.json and README.md to `--out`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings

from benchmarks.harness.environment import git_commit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from hostile.api_doors import MessagesDoor, ResponsesDoor  # noqa: E402
from hostile.api_strategies import API_CI_EXAMPLES, API_FAMILIES  # noqa: E402
from hostile.doors import Finding, FuzzTarget, HttpDoor, ZmqDoor, greedy_reference, run_case  # noqa: E402
from hostile.strategies import CI_EXAMPLES, FAMILIES, OPENAI_FAMILIES, Case  # noqa: E402
from support.tiny_models import save_tiny_pair  # noqa: E402

KINDS = ("crash", "hang", "bad_answer", "exact")
DOORS = {"zmq": ZmqDoor, "http": HttpDoor, "responses": ResponsesDoor, "messages": MessagesDoor}
"""Each door by name: the socket, the OpenAI routes, /v1/responses, /v1/messages."""
OWN_FAMILIES = {"http": list(OPENAI_FAMILIES), "responses": ["responses_body"], "messages": ["messages_body"]}
"""The families a door runs beside the door-neutral ones (the OpenAI door's: its routes, the embedding routes,
`n` × `echo` × `logprobs` amplification and forwarded-header spoofing among them)."""


class Tally:
    """Counts of one door: requests, served, refused by code, findings by kind, and the first case of each."""

    def __init__(self) -> None:
        self.requests = 0
        self.served = 0
        self.refused: Counter[str] = Counter()
        self.findings: Counter[str] = Counter()
        self.by_family: dict[str, Counter[str]] = {}
        self.first: list[dict[str, str]] = []

    def count(self, family: str, outcome: str) -> None:
        self.by_family.setdefault(family, Counter())[outcome] += 1

    def finding(self, family: str, exc: Finding) -> None:
        self.findings[exc.kind] += 1
        self.count(family, exc.kind)
        if not any(f["family"] == family and f["kind"] == exc.kind for f in self.first):
            self.first.append({"family": family, "kind": exc.kind, "finding": str(exc)[:1500]})

    def as_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "served": self.served, "refused": dict(sorted(self.refused.items())),
                "crashes": self.findings["crash"], "hangs": self.findings["hang"],
                "bad_answers": self.findings["bad_answer"], "exact_mismatches": self.findings["exact"],
                "by_family": {f: dict(c) for f, c in sorted(self.by_family.items())}, "first_findings": self.first}


def split(examples: int, door: str) -> dict[str, int]:
    """`examples` cases over `door`'s families (the door-neutral ones and its own) in the CI run's proportions
    (at least one each)."""
    every = CI_EXAMPLES | API_CI_EXAMPLES
    counts = {f: every[f] for f in FAMILIES} | {f: every[f] for f in OWN_FAMILIES.get(door, ())}
    total = sum(counts.values())
    return {family: max(1, round(examples * n / total)) for family, n in counts.items()}


def run_family(target: FuzzTarget, door: ZmqDoor | HttpDoor | ResponsesDoor | MessagesDoor, family: str,
               examples: int, seed_value: int, tally: Tally, check_every: int) -> None:
    """Run `examples` cases of one family through `door`, counting every outcome; never raises a Finding."""

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=(FAMILIES | OPENAI_FAMILIES | API_FAMILIES)[family])
    def one(case: Case) -> None:
        tally.requests += 1
        try:
            outcome = run_case(target, door, case)
        except Finding as exc:
            tally.finding(family, exc)
            return
        if outcome.verdict == "served":
            tally.served += 1
            tally.count(family, "served")
        else:
            tally.refused[outcome.code] += 1
            tally.count(family, f"refused {outcome.code}")
        if tally.requests % check_every == 0:
            check_exact(target, family, tally)

    one()
    check_exact(target, family, tally)


def check_exact(target: FuzzTarget, family: str, tally: Tally) -> None:
    """Exact mode against greedy; a mismatch or failure is counted and the daemon restarted."""
    try:
        target.ensure_running()
        target.check_exact()
    except Finding as exc:
        target.suspect = True
        tally.finding(family, exc)


def readme(counts: dict[str, Any]) -> str:
    """A short README.md over the counts."""
    rows = ["| door | requests | served | refused (by code) | crashes | hangs | bad answers | exact mismatches |",
            "|---|---|---|---|---|---|---|---|"]
    for name, door in counts["doors"].items():
        refused = ", ".join(f"{code} {n}" for code, n in door["refused"].items()) or "0"
        rows.append(f"| {name} | {door['requests']} | {door['served']} | {refused} | {door['crashes']} | "
                    f"{door['hangs']} | {door['bad_answers']} | {door['exact_mismatches']} |")
    firsts = [f"- {name} / {f['family']} ({f['kind']}): {f['finding'].splitlines()[-1][:200]}"
              for name, door in counts["doors"].items() for f in door["first_findings"]]
    return "\n".join([
        "# Hostile-content fuzzer counts (issue 33)", "",
        *([counts["note"], ""] if counts.get("note") else []),
        f"`{counts['command']}` on commit {counts['commit']}, {counts['elapsed_s']:.0f} s: "
        f"{counts['examples_per_door']} cases per door (tests/hostile/strategies.py families, CI proportions), "
        f"a tiny random pair in a daemon subprocess (started {counts['daemon_starts']} times), ZeroMQ raw frames "
        "and HTTP bodies.", "",
        *rows, "",
        "Findings (first per door and family; whole text in counts.json):" if firsts else "No findings.",
        *firsts, "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=4000, help="cases per door")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=50, help="cases between exact-mode checks")
    parser.add_argument("--doors", nargs="+", default=list(DOORS), choices=list(DOORS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hostile-fuzz"))
    parser.add_argument("--commit", default=None, help="the fuzzed code's commit, when not this checkout's HEAD")
    parser.add_argument("--note", default="", help="a sentence for the README (what this run was for)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hostile-fuzz-") as tmp:
        dirs = save_tiny_pair(Path(tmp) / "pair", "llama")
        target = FuzzTarget(*dirs, Path(tmp), greedy_reference(dirs[0]))
        tallies = {name: Tally() for name in args.doors}
        try:
            for name in args.doors:
                door = DOORS[name](target)
                for i, (family, n) in enumerate(split(args.examples, name).items()):
                    run_family(target, door, family, n, args.seed * 1000 + i, tallies[name], args.check_every)
                    print(f"{name} {family}: {dict(tallies[name].by_family.get(family, {}))}", flush=True)
        finally:
            target.stop()
    command = shlex.join(["python", "benchmarks/serving/hostile_fuzz.py", *(argv if argv is not None else sys.argv[1:])])
    counts = {"command": command, "commit": args.commit or git_commit() or "unknown", "note": args.note, "seed": args.seed,
              "examples_per_door": args.examples,
              "elapsed_s": round(time.monotonic() - start, 1), "daemon_starts": target.starts,
              "doors": {name: tally.as_json() for name, tally in tallies.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "counts.json").write_text(json.dumps(counts, indent=1) + "\n")
    (args.out / "README.md").write_text(readme(counts))
    print(readme(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
