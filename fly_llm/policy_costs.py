"""The adaptive policy's timed costs, kept per machine and models (docs/design.md §1.4).

FLy-mode output depends on the policy's plans and the plans on its costs (`Costs`), so costs timed
afresh at every start would let a restarted daemon give other loose greedy answers. The first start
times them (`Costs.measure`, a few seconds) and keeps them in `<model cache>/policy-costs/<key>.json`;
later starts with the same key load them and time nothing. The key is a digest of everything the
timing depends on (`costs_identity`: the models, dtype, quantization, the native kernels' build keys,
torch's version and thread count, the CPU or GPU), which the file also stores readably. An
unreadable file is logged and measured again; `FLY_REMEASURE_COSTS=1` forces a new measurement.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fly_llm.decoding.policy import Costs
from fly_llm.model import kernels
from fly_llm.model.cache import MANIFEST
from fly_llm.model.cache_paths import cache_root
from fly_llm.model.kernels.build import build_directory
from fly_llm.model.kernels.cpu import cpu_flags, cpu_model
from fly_llm.model.kernels.w4a8 import ISA_ENV
from fly_llm.model.pair import LoadedModels

log = logging.getLogger(__name__)

REMEASURE_ENV = "FLY_REMEASURE_COSTS"  # set (not '0'): time the costs again and overwrite the kept file
DIRECTORY = "policy-costs"  # under the model cache
FORMAT = 5  # 2: the target timed at several widths (Costs.target_widths); 3: target and draft in turns;
# 4: the draft's step a one-token forward (it was a 4-token one), its wider forwards in StageCost.widths;
# 5: each cost the median over rounds of a ratio within a round (it was a ratio of fastest forwards: dear)


def policy_costs(loaded: LoadedModels) -> Costs:
    """The costs kept for these models on this machine, or timed now and kept (one log line either way)."""
    identity = costs_identity(loaded)
    path = costs_path(identity)
    if os.environ.get(REMEASURE_ENV, "") in ("", "0"):
        costs = _read(path, identity)
        if costs is not None:
            log.info("policy costs loaded from %s: %s", path, describe(costs))
            return costs
    started = time.perf_counter()
    costs = Costs.measure(loaded.target, loaded.draft)
    kept = _write(path, identity, costs)
    log.info("policy costs measured in %.1f s%s: %s", time.perf_counter() - started,
             f", kept in {path}" if kept else " (not kept)", describe(costs))
    return costs


def costs_identity(loaded: LoadedModels) -> dict[str, Any]:
    """Everything the timed costs depend on, as plain JSON values."""
    return {
        "format": FORMAT,
        "target": _model_identity(loaded.target_name, loaded.target),
        "draft": None if loaded.draft is None else _model_identity(loaded.draft_name, loaded.draft),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "quantization": {"target": loaded.target_quantization, "draft": loaded.draft_quantization},
        "draft_vocabulary": loaded.draft_vocabulary,
        "draft_weights": loaded.draft_weights,
        "kernels": _kernel_keys(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": _device_identity(loaded.device),
    }


def costs_path(identity: dict[str, Any]) -> Path:
    """The file that keeps the costs of `identity`: named by the sha256 of its canonical JSON."""
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return cache_root() / DIRECTORY / f"{key[:16]}.json"


def describe(costs: Costs) -> str:
    """The costs on one line, e.g. 'target_token=0.0071 (w=2: 1.05, w=4: 1.24), draft_model step=0.412
    (w=2: 1.08, w=4: 1.27) prefill=0.0480'."""
    stages = (f"{name} step={cost.step:.3f}{_widths(cost.widths)} prefill={cost.prefill:.4f}"
              for name, cost in costs.stages.items())
    return ", ".join([f"target_token={costs.target_token:.4f}{_widths(costs.target_widths)}", *stages])


def _widths(table: tuple[tuple[int, float], ...]) -> str:
    """' (w=2: 1.05, w=4: 1.24)', or nothing for no table."""
    return " (" + ", ".join(f"w={width}: {cost:.2f}" for width, cost in table) + ")" if table else ""


def _model_identity(name: str | None, model: torch.nn.Module) -> dict[str, Any]:
    """What identifies a loaded model: its name, where it was loaded from, its shape (parameter count),
    and the model cache's manifest digest or the Hub revision where there is one."""
    source = str(getattr(model.config, "_name_or_path", "") or name)
    identity: dict[str, Any] = {"name": name, "source": source,
                                "parameters": sum(p.numel() for p in model.parameters())}
    manifest = Path(source) / MANIFEST
    if manifest.is_file():
        identity["manifest"] = hashlib.sha256(manifest.read_bytes()).hexdigest()
    elif revision := getattr(model.config, "_commit_hash", None):
        identity["revision"] = revision
    return identity


def _kernel_keys() -> dict[str, str]:
    """Every native kernel's build key (its source, torch and Python: `build_directory`) and the w4a8 ISA asked for."""
    sources = sorted(Path(kernels.__file__).parent.glob("*.cpp"))
    return {**{source.stem: build_directory(source.stem, source).name for source in sources},
            ISA_ENV: os.environ.get(ISA_ENV, "auto")}


def _device_identity(device: torch.device) -> dict[str, str]:
    """The GPU's name, or the CPU's model name and a digest of its feature flags."""
    if device.type == "cuda":
        return {"gpu": torch.cuda.get_device_name(device)}
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    return {"cpu": cpu_model(), "flags": flags}


def _read(path: Path, identity: dict[str, Any]) -> Costs | None:
    """The costs kept in `path` for `identity`; None (logged unless the file is simply absent) otherwise."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("identity") != identity:
            raise ValueError("it was kept for other models or another machine")
        costs = Costs.from_dict(data["costs"])
        tables = [costs.target_widths, *(cost.widths for cost in costs.stages.values())]
        values = [costs.target_token, *(v for cost in costs.stages.values() for v in (cost.step, cost.prefill)),
                  *(c for table in tables for _, c in table)]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"not a cost: {values}")
        for table in tables:
            widths = [1, *(w for w, _ in table)]
            if any(a >= b for a, b in zip(widths, widths[1:])):
                raise ValueError(f"widths not rising from 2: {widths[1:]}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("the policy costs in %s are unreadable (%s: %s); measuring them again",
                    path, type(exc).__name__, exc)
        return None
    return costs


def _write(path: Path, identity: dict[str, Any], costs: Costs) -> bool:
    """Keep `costs` in `path`, atomically (a temporary file renamed into place); False (logged) if it cannot."""
    record = {"identity": identity, "costs": asdict(costs), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staged = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
            os.replace(staged, path)  # a reader sees the old file or the new one, never half
        finally:
            Path(staged).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not keep the policy costs in %s (%s); the next start measures them again", path, exc)
        return False
    return True
