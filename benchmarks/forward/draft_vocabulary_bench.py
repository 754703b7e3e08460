"""What a draft head over part of the vocabulary (fly_llm.model.draft_vocabulary) saves and costs, on the
embedded pair (issue 44: a cheaper draft step):

    python benchmarks/forward/draft_vocabulary_bench.py --sizes 0 65536 49152 32768 --out benchmarks/results/draft-vocabulary

- **Cost**: the draft's forward over one new token after 300 cached, per size (0: the full head), the
  drafts loaded side by side and timed in turns (`--rounds`), medians reported;
- **Agreement**: the draft's greedy choice against the next token of the embedded target's own answers (the
  committed GSM8K and HumanEval parts of benchmarks/results/quality-published, `--items` of each, teacher
  forced over the answer's tokens alone), per size: how often the draft would propose the target's token.
  A kept set only loses where the target's token is outside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness.environment import cpu_name
from fly_llm.common.config import ModelSpec
from fly_llm.decoding.policy import _forward_seconds
from fly_llm.model.embedded import ensure_default_pair
from fly_llm.model.pair import load_models

PARTS = Path(__file__).resolve().parents[1] / "results" / "quality-published" / "parts"
SETS = ("gsm8k", "humaneval")


def forward_ms(drafts: dict[int, torch.nn.Module], rounds: int) -> dict[int, list[float]]:
    """Per size, one forward over one new token after 300 cached per round (fastest of 4), in ms."""
    times: dict[int, list[float]] = {size: [] for size in drafts}
    with torch.inference_mode():
        for _ in range(rounds):
            for size, draft in drafts.items():
                times[size].append(_forward_seconds(draft, 300, (1,), 4)[0] * 1000)
    return times


def agreement(drafts: dict[int, torch.nn.Module], items: int) -> dict[str, dict[int, float]]:
    """Per set and size, the share of answer positions where the draft's greedy token is the target's next.
    The drafts differ in their heads only: the hidden states come from one of them, once per answer."""
    trunk = next(iter(drafts.values())).get_decoder()
    shares: dict[str, dict[int, float]] = {}
    for name in SETS:
        answers = [json.loads(line)["token_ids"] for line in (PARTS / f"{name}.target.jsonl").open()][:items]
        hits = {size: 0 for size in drafts}
        positions = 0
        for ids in (a for a in answers if len(a) > 1):
            following = torch.tensor(ids[1:])
            positions += len(following)
            with torch.inference_mode():
                hidden = trunk(torch.tensor([ids]), use_cache=False).last_hidden_state[0, :-1]
                for size, draft in drafts.items():
                    logits = draft.get_output_embeddings()(hidden)
                    hits[size] += int((logits.argmax(-1) == following).sum())
        shares[name] = {size: hits[size] / positions for size in drafts}
        shares[name]["positions"] = positions
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 65536, 49152, 32768])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--items", type=int, default=50, help="answers of each set for the agreement")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, draft = ensure_default_pair(progress=False)
    drafts = {size: load_models(ModelSpec(target=str(draft), draft=str(draft), dtype="auto", draft_vocabulary=size),
                                progress=False).draft for size in args.sizes}  # the draft as its own target: lighter
    times = forward_ms(drafts, args.rounds)
    shares = agreement(drafts, args.items)
    result = {"cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__, "when": time.strftime("%F %T"),
              "forward_ms": times, "agreement": shares}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    full = statistics.median(times[args.sizes[0]])
    lines = [f"# The draft's head over part of the vocabulary ({result['cpu']}, {args.threads} threads, "
             f"torch {torch.__version__}, {result['when']})", "",
             f"Draft forward over 1 new token after 300 cached (median of {args.rounds} rounds in turns); agreement: "
             f"the draft's greedy token = the target's next, teacher forced over {args.items} committed answers "
             f"of each set.", "",
             "| tokens scored (0: all) | forward ms | vs all | " + " | ".join(
                 f"{name} agreement ({shares[name]['positions']} positions)" for name in SETS) + " |",
             "|---:|---:|---:|" + "---:|" * len(SETS)]
    for size in args.sizes:
        ms = statistics.median(times[size])
        lines.append(f"| {size} | {ms:.2f} | {ms / full:.2f} | " +
                     " | ".join(f"{shares[name][size] * 100:.2f}%" for name in SETS) + " |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
