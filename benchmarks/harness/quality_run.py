"""`fly-bench --quality`: many items decoded at once, scored, and kept in resumable parts.

Each (dataset, method) is one part. Its items go through one FLyEngine with continuous batching
(`--batch` rows; a finished row's place goes to the next item), and every finished item is scored
and appended as one JSON line to `parts/<dataset>.<method>.jsonl` under `--out`. Rerunning the same
command skips the items already there, so a run longer than one sitting continues where it
stopped, and parts copied in from another run merge (the first line of an item wins). Method
`target` is the engine with speculation off: plain greedy decoding, one token per target forward,
the reference of every comparison (exact mode is lossless, so `spd` must equal it token for token).

Speed here is throughput, the batch's tokens per second over each sitting (`*.timing.jsonl`), not
the batch-1 latency of the other tables.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.datasets import Item
from benchmarks.harness.methods import Method, Runner
from benchmarks.harness.quality import score
from benchmarks.harness.report import REFERENCE
from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.policy import AdaptivePolicy, Costs, PolicyState, RowAsk
from fly_llm.decoding.stages import DraftPlan, Stage
from fly_llm.common.stats import RequestStats
from fly_llm.model.kernels.cpu import cpu_model

PLAIN = FLyConfig(loose=False, adaptive=False, ngram=False, draft_model=False)
"""Speculation off: one target forward per token (the quality runs' `target`)."""
QUALITY_METHODS = ["target", "spd", "fly", "fly-w0", "fly-w4", "fly-no-gate"]
"""The default methods of a quality run: the paper's ablation trend (W=6 is `fly`)."""
DEFAULT_BATCH = 8


@dataclass
class ItemRecord:
    """One item decoded by one method in a quality run, scored."""

    item_id: str
    passed: bool | None  # None: an unscored prompt set
    tokens: int
    hit_limit: bool  # stopped at --max-tokens rather than at its end
    token_ids: list[int]
    text: str
    stats: dict[str, Any]


@dataclass
class Sitting:
    """One uninterrupted stretch of a part: how many items and tokens it decoded, in how long."""

    items: int
    tokens: int
    seconds: float
    batch: int
    machine: str = ""  # what decoded it (`machine_kind`); "" in sittings recorded before it was kept


def machine_kind(model: Any) -> str:
    """The numerics a part was decoded with: device, the CPU's vector ISA and model name (or the
    GPU), dtype and torch's thread count.

    Greedy tokens are reproducible on one kind of machine, not across them: an AVX2 and an AVX-512
    CPU round the int8 target differently, and so do 1 and 2 threads on one CPU (GSM8K item 232's
    first token, 2026-12-04), so parts pair only within one kind."""
    import torch

    device = model.device
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"{torch.backends.cpu.get_cpu_capability()} {cpu_model()}"
    return f"{device.type} {hardware} {str(model.dtype).removeprefix('torch.')} {torch.get_num_threads()} threads"


class QualityModeError(ValueError):
    """A quality run asked for something it cannot do (a method that does not batch)."""


def check_method(method: Method) -> None:
    """QualityModeError unless a quality run can take `method`: the engine's methods (batched) and
    llama.cpp (one item at a time, on its own kernels)."""
    if method.kind != "llamacpp":
        engine_config(method)


def engine_config(method: Method) -> FLyConfig:
    """The FLyConfig a method runs with in the engine; `target` is speculation off."""
    if method.kind == "engine":
        return method.fly
    if method.name == REFERENCE:
        return PLAIN
    raise QualityModeError(f"method {method.name!r} does not run batched: quality runs take the target, "
                           f"FLyEngine methods ({', '.join(QUALITY_METHODS)}, and the other fly-* ablations) "
                           f"and llamacpp")


class SingleStreamPolicy(AdaptivePolicy):
    """The adaptive policy planning every row as if it ran alone (batch size 1).

    Quality is measured for what one user's request gets. The engine's policy weighs a round's
    cost by the batch size, and at 8 rows on a CPU it stops drafting altogether: a batched quality
    run would then measure plain decoding under FLy's name. Planning as at batch 1 keeps each
    item's drafting (and so its loose acceptances) what it is when the item runs alone.
    """

    def plan(self, state: PolicyState, fly: FLyConfig, budget: int, batch_size: int,
             offered: Sequence[Stage]) -> DraftPlan:
        """AdaptivePolicy.plan with the batch size taken as 1."""
        return super().plan(state, fly, budget, 1, offered)

    def plan_round(self, asks: Sequence[RowAsk]) -> list[DraftPlan]:
        """Every row planned alone: no round is priced at the batch's width."""
        return [self.plan(a.state, a.fly, a.budget, 1, a.offered) for a in asks]

    def observe(self, state: PolicyState, plan: DraftPlan, drafted: int, accepted: int, forwards: int = 0,
                *, loose: int = 0, window: int | None = None, batch_size: int = 1) -> None:
        """AdaptivePolicy.observe with the batch size taken as 1 (a round's realized cost as if alone)."""
        super().observe(state, plan, drafted, accepted, forwards, loose=loose, window=window, batch_size=1)


def policy_costs(out: Path, target: Any, draft: Any) -> Costs:
    """The adaptive policy's costs for every sitting of a run: timed on its first sitting and kept in
    `policy_costs.json` under `out`, so a resumed part drafts as the uninterrupted run would have."""
    path = out / "policy_costs.json"
    if path.exists():
        return Costs.from_dict(json.loads(path.read_text(encoding="utf-8")))
    costs = Costs.measure(target, draft)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(costs)) + "\n", encoding="utf-8")
    return costs


def part_path(out: Path, dataset: str, method: str) -> Path:
    """Where the items of one (dataset, method) part are appended."""
    safe = dataset.replace("/", "_").replace(":", "_")
    return out / "parts" / f"{safe}.{method}.jsonl"


def read_records(path: Path) -> dict[str, ItemRecord]:
    """The items of a part file by id (the first line of an id wins); empty if there is none."""
    records: dict[str, ItemRecord] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = ItemRecord(**json.loads(line))
                records.setdefault(record.item_id, record)
    return records


def read_sittings(path: Path) -> list[Sitting]:
    """The sittings recorded for a part file."""
    timing = path.with_suffix(".timing.jsonl")
    if not timing.exists():
        return []
    return [Sitting(**json.loads(line)) for line in timing.read_text(encoding="utf-8").splitlines() if line.strip()]


def _append(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def decode_batched(runner: Runner, config: FLyConfig, prompts: list[tuple[str, list[int]]], batch: int,
                   max_tokens: int, finished: Callable[[str, list[int], bool, RequestStats], None]) -> None:
    """Decode every (id, prompt ids) greedily with at most `batch` rows at once; call
    `finished(id, token ids, hit_limit, stats)` as each one ends."""
    engine = runner.engine
    queue = list(reversed(prompts))
    running: dict[str, list[int]] = {}
    sampling = SamplingParams(max_tokens=max_tokens)
    while queue or running:
        while queue and len(running) < batch:
            item_id, ids = queue.pop()
            engine.add_request(item_id, ids, sampling, fly=config)
            running[item_id] = []
        for out in engine.step():
            running[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished(out.request_id, runner.strip_eos(running.pop(out.request_id)),
                         out.finish_reason == "length", out.stats.model_copy(deep=True))


def run_part(runner: Runner, method: Method, items: list[Item], prompts: list[list[int]], out: Path,
             batch: int, timeout: float) -> None:
    """Decode, score and append the items of one part not yet in its file; record the sitting."""
    from tqdm import tqdm

    dataset = items[0].dataset
    path = part_path(out, dataset, method.name)
    done = read_records(path)
    todo = [(item, ids) for item, ids in zip(items, prompts) if item.item_id not in done]
    if not todo:
        return
    by_id = {item.item_id: item for item, _ in todo}
    bar = tqdm(total=len(items), initial=len(items) - len(todo), desc=f"{dataset}/{method.name}", unit="item")
    tokens = 0

    def finished(item_id: str, token_ids: list[int], hit_limit: bool, stats: RequestStats) -> None:
        nonlocal tokens
        text = runner.tokenizer.decode(token_ids, skip_special_tokens=True)
        record = ItemRecord(item_id, score(by_id[item_id], text, timeout), len(token_ids), hit_limit, token_ids,
                            text, stats.model_dump())
        _append(path, asdict(record))
        tokens += len(token_ids)
        bar.update()

    start = time.perf_counter()
    if method.kind == "llamacpp":  # llama.cpp decodes one sequence at a time
        batch = 1
        for item, ids in todo:
            run = runner.run(method, ids)
            finished(item.item_id, run.token_ids, len(run.token_ids) >= runner.max_tokens,
                     RequestStats(rounds=run.target_forwards, emitted=len(run.token_ids)))
    else:
        decode_batched(runner, engine_config(method), [(item.item_id, ids) for item, ids in todo], batch,
                       runner.max_tokens, finished)
    _append(path.with_suffix(".timing.jsonl"),
            asdict(Sitting(len(todo), tokens, round(time.perf_counter() - start, 3), batch,
                           machine_kind(runner.target))))
    bar.close()


def run_quality(runner: Runner, methods: list[Method], datasets: dict[str, tuple[list[Item], list[list[int]]]],
                out: Path, batch: int, timeout: float) -> None:
    """Every part of a quality run (dataset by dataset, method by method), skipping finished items.

    The target-only part of a dataset runs after its other methods, so that runs of different methods
    started side by side into the same `out` do not each decode it first. Every method must run in the
    engine (`engine_config`; fly-bench checks that before loading models)."""
    window = runner.engine.context_window
    for items, prompts in datasets.values():
        for item, ids in zip(items, prompts):
            if len(ids) >= window:
                raise QualityModeError(f"{item.item_id}: the prompt has {len(ids)} tokens; the target's context "
                                       f"window is {window}")
    for items, prompts in datasets.values():
        for method in sorted(methods, key=lambda m: m.name == REFERENCE):
            if items:
                run_part(runner, method, items, prompts, out, batch, timeout)
