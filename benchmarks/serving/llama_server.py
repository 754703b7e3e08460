"""llama.cpp's own `llama-server` in the serving benchmarks: its modes' command lines, what the binary says
about its build and the machine, and the weight bytes a forward of a GGUF reads.

The binary is built by build_llama_server.sh from the llama.cpp tree that llama-cpp-python's sdist vendors
(0.3.36: llama.cpp 0.5.0-dev, commit 0c1e570). The flags, as that tree's common/arg.cpp and
common/speculative.cpp define them: a draft model is `-md FILE` with `--spec-type draft-simple`,
`--spec-draft-n-max N` (tokens drafted per step, default 3) and `--spec-draft-p-min P` (stop drafting below
this draft probability, default 0); self-speculation without a second model is `--spec-type` with one of
NGRAM_TYPES, each at its defaults. Everything else stays at llama.cpp's defaults (flash attention auto,
f16 KV cache, 4 slots, ...) but the address and `-t`.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.serving.webui_check import free_port

LLAMA_SERVER = Path("/work/llama-server/build/bin/llama-server")
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
SWEEP_N_MAX = (4, 8, 16)
SWEEP_P_MIN = (0.5, 0.75, 0.9)
ACTIVATIONS = "int8 matmul inputs (Q8_K / Q8_0 blocks), float32 otherwise, f16 KV cache"
"""What llama.cpp's CPU backend computes a Q4_K_M model's forward in (ggml's vec_dot types)."""
FLASH_ATTN_OFF = "Flash Attention not supported"
"""The warning llama.cpp logs (at the default verbosity) when `-fa auto` turns flash attention off; where
auto turns it on it says so at trace level only."""


@dataclass(frozen=True)
class Mode:
    """One way to run llama-server: its speculative-decoding flags (none: plain decoding) and whether it
    drafts with the draft model's GGUF (`-md`)."""

    name: str
    flags: tuple[str, ...] = ()
    draft: bool = False


def _modes() -> dict[str, Mode]:
    draft = ("--spec-type", "draft-simple")
    sweep = [Mode(f"llama-server-draft-n{n}-p{p:g}", (*draft, "--spec-draft-n-max", str(n), "--spec-draft-p-min", f"{p:g}"),
                  draft=True) for n in SWEEP_N_MAX for p in SWEEP_P_MIN]
    ngram = [Mode(f"llama-server-{t}", ("--spec-type", t)) for t in NGRAM_TYPES]
    return {m.name: m for m in [Mode("llama-server"), Mode("llama-server-draft", draft, draft=True), *sweep, *ngram]}


MODES = _modes()
"""`llama-server` (plain), `llama-server-draft` (the draft at llama.cpp's defaults), the sweep
`llama-server-draft-n{N}-p{P}` over SWEEP_N_MAX × SWEEP_P_MIN, and `llama-server-{ngram type}`."""


def command(binary: Path, mode: Mode, gguf: Path, draft_gguf: Path | None, port: int, threads: int) -> list[str]:
    """The command line of `mode` on `gguf` (and `draft_gguf` where it drafts with the draft model)."""
    if mode.draft and draft_gguf is None:
        raise ValueError(f"{mode.name} drafts with the draft model: give its .gguf file")
    return [str(binary), "-m", str(gguf), *(("-md", str(draft_gguf)) if mode.draft else ()), *mode.flags,
            "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]


def build_info(binary: Path) -> str | None:
    """build_llama_server.sh's build-info.txt next to the binary (source, cmake flags, compiler), on one line;
    None without it."""
    path = binary.parent / "build-info.txt"
    return "; ".join(path.read_text().split("\n")).strip("; ") if path.exists() else None


def lines_with(log: str, needle: str) -> list[str]:
    """Each distinct log line holding `needle`, from `needle` on, whitespace folded (the log's time and
    source prefix dropped)."""
    found = [" ".join(line[line.index(needle):].split()) for line in log.splitlines() if needle in line]
    return list(dict.fromkeys(found))


def probe(binary: Path, threads: int, timeout: float = 120) -> dict[str, Any]:
    """What `binary` says about itself: its `--version`, build_llama_server.sh's build info and the
    `system_info` line (its CPU features as built, and the threads) that it logs at start.

    llama-server logs that line at verbosity 4 (trace) only, so it comes from a start of its own with
    `-lv 4`, the same `-t` and a model path that does not exist: it exits before loading anything, and
    the measured start keeps every default."""
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="fly-llama-probe-") as tmp:
        start = subprocess.run([str(binary), "-lv", "4", "-t", str(threads), "-m", str(Path(tmp) / "none.gguf"),
                                "--host", "127.0.0.1", "--port", str(free_port())],
                               capture_output=True, text=True, timeout=timeout)
    system = lines_with(start.stdout + start.stderr, "system_info:")
    return {"version": " ".join((version.stdout + version.stderr).split()), "build": build_info(binary),
            "system_info": system[0] if system else None}


def log_facts(log: str) -> dict[str, list[str]]:
    """What a measured start's log (default verbosity) says: flash attention (auto, and on unless it warned
    that it turned it off), the slots and context, the threads."""
    return {"flash_attn": lines_with(log, FLASH_ATTN_OFF) or [f"flash_attn = auto, on (no '{FLASH_ATTN_OFF}')"],
            "slots": lines_with(log, "n_slots"), "threads": lines_with(log, "threadpool init")}


def weight_bytes(gguf: Path) -> int:
    """The weight bytes one forward over `gguf` reads: every tensor, but the token embedding table where the
    file has its own output head (a forward reads one row of the table per token; with tied embeddings the
    table is the head and is read whole)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    tied = "output.weight" not in tensors
    return sum(tensors.values()) - (0 if tied else tensors.get("token_embd.weight", 0))
