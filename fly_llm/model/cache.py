"""A safetensors cache of GGUF models: convert once (slow), load fast afterwards.

Layout: `<root>/<key>/` is an ordinary Hugging Face model directory (config, generation config,
bfloat16 safetensors, tokenizer) plus `fly-published.safetensors` (the GGUF's Linear weights as
published, raw, with their block types, for the w4a8 kernel: fly_llm.model.kernels.gguf_blocks) and
`fly-manifest.json`. It is built
in `<root>/.tmp-<key>-*` and renamed into place only when complete, so a crash leaves nothing that
loads. The manifest (written last, atomically) records every file's size and sha256 — of the whole
file below 64 MiB, of its first and last MiB above — and is checked on every load: a few MiB of
reading, so a truncated, half-copied or overwritten cache is rebuilt instead of loaded. A cache
built before the published weights were kept (or when fewer block types were read as published) gets
them written anew from the GGUF (the float weights stay).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from filelock import FileLock
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig
from transformers.utils import logging as hf_logging

from fly_llm.common.errors import ModelError
from fly_llm.model.kernels.gguf_blocks import PublishedWeights, is_current, published_blocks, save_published

log = logging.getLogger(__name__)

MANIFEST = "fly-manifest.json"
PUBLISHED = "fly-published.safetensors"
MANIFEST_FORMAT = 1
CACHE_DTYPE = torch.bfloat16  # the Qwen checkpoints' own dtype; far finer than the Q4_K_M quantisation
_FULL_HASH_BELOW = 64 << 20
_EDGE = 1 << 20


def _file_digest(path: Path, size: int) -> str:
    """sha256 of the file if small, else of its first and last MiB (cheap enough for every load)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size < _FULL_HASH_BELOW:
            digest.update(f.read())
        else:
            digest.update(f.read(_EDGE))
            f.seek(size - _EDGE)
            digest.update(f.read(_EDGE))
    return digest.hexdigest()


def write_manifest(model_dir: Path, source: dict) -> None:
    """Record size and digest of every file in `model_dir` (call last, when the dir is complete)."""
    files = {}
    staged = model_dir / f".{MANIFEST}.tmp"
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name not in (MANIFEST, staged.name)):
        size = path.stat().st_size
        files[path.relative_to(model_dir).as_posix()] = {"size": size, "sha256": _file_digest(path, size)}
    manifest = {"format": MANIFEST_FORMAT, "source": source, "files": files}
    staged.write_text(json.dumps(manifest, indent=1))
    os.replace(staged, model_dir / MANIFEST)  # a reader sees the old manifest or the new one, never half


def _manifest(model_dir: Path) -> dict:
    return json.loads((model_dir / MANIFEST).read_text())


def cache_problem(model_dir: Path) -> str | None:
    """Why `model_dir` is not a usable cache (None if it is): missing, unfinished or corrupted."""
    try:
        manifest = _manifest(model_dir)
    except FileNotFoundError:
        return "no manifest (never finished)" if model_dir.exists() else "not built yet"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    if manifest.get("format") != MANIFEST_FORMAT or not manifest.get("files"):
        return "unknown manifest format"
    for name, entry in manifest["files"].items():
        path = model_dir / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != entry["size"]:
            return f"{name} has {size} bytes, expected {entry['size']}"
        if _file_digest(path, size) != entry["sha256"]:
            return f"{name} has changed (checksum)"
    return None


def has_published(model_dir: Path) -> bool:
    """Whether a checked cache's manifest lists its published weights in the current format (caches built
    before them, or when fewer block types were read, do not)."""
    return PUBLISHED in _manifest(model_dir)["files"] and is_current(model_dir / PUBLISHED)


def published_weights(model_dir: Path | str) -> PublishedWeights | None:
    """The published Linear weights of a model cache directory (as its manifest lists them);
    None for any other model directory or id."""
    model_dir = Path(model_dir)
    if not (model_dir / MANIFEST).is_file() or cache_problem(model_dir) or not has_published(model_dir):
        return None
    return PublishedWeights(model_dir / PUBLISHED)


def write_published(gguf: Path, model_dir: Path, path: Path) -> None:
    """Save to `path` the GGUF's published Linear weights, named as in the model converted to `model_dir`."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    save_published(published_blocks(gguf, skeleton), path)


@contextmanager
def hf_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own progress bars for the duration."""
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def convert_gguf(gguf: Path, out: Path, *, name: str, progress: bool = True,
                 before_save: Callable[[], None] | None = None) -> None:
    """Dequantise a GGUF file and save it to `out` as a safetensors model directory, with its
    published Linear weights beside (`PUBLISHED`).

    transformers 5 refuses `save_pretrained` on a GGUF-loaded model, so the weights are moved
    (not copied) into a plain model built from the same config and saved from there.
    `before_save` runs once the weights are in memory (e.g. to delete a temporary GGUF).
    """
    steps = tqdm(total=3, desc=f"Converting {name}", unit="step", disable=not progress)
    with hf_progress(progress):
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        steps.set_postfix_str("weights")
        # dequantize=True: plain dense weights even where a packed-GGUF matmul kernel is installed.
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=CACHE_DTYPE,
                                                      quantization_config=GgufConfig(dequantize=True),
                                                      use_kernels=False)  # no Hub kernels (fly_llm.model.pair)
        steps.update()
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = CACHE_DTYPE
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=CACHE_DTYPE)
    published = published_blocks(gguf, plain)
    if before_save is not None:
        before_save()
    steps.set_postfix_str("saving")
    plain.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    plain.generation_config = loaded.generation_config
    del loaded
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_published(published, out / PUBLISHED)
    steps.update()
    steps.close()


def cached_conversion(root: Path, key: str, make_gguf: Callable[[Path], Path], *, progress: bool = True,
                      source: dict | None = None) -> Path:
    """Return `<root>/<key>`, converting the GGUF that `make_gguf(workdir)` returns if needed.

    A GGUF that `make_gguf` writes inside `workdir` is deleted as soon as its weights are in
    memory (it is only an intermediate); a GGUF elsewhere (the user's) is never touched.
    One process builds a given key at a time (file lock); the others wait and reuse it.
    """
    final = root / key
    if cache_problem(final) is None and has_published(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{key}.lock")):
        problem = cache_problem(final)
        if problem is None and has_published(final):  # another process built it while we waited
            return final
        for stale in root.glob(f".tmp-{key}-*"):  # left by a crashed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        if problem is not None and final.exists():
            log.warning("rebuilding the model cache %s: %s", final, problem)
            shutil.rmtree(final)
        workdir = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            gguf = make_gguf(workdir)
            staged = workdir / "model"
            try:
                if problem is None:  # a cache from before the published weights: add them, keep the rest
                    log.info("adding the GGUF's published weights to the model cache %s", final)
                    staged.mkdir()
                    write_published(gguf, final, staged / PUBLISHED)
                    os.replace(staged / PUBLISHED, final / PUBLISHED)
                else:
                    convert_gguf(gguf, staged, name=key, progress=progress,
                                 before_save=(lambda: gguf.unlink()) if workdir in gguf.parents else None)
            except ModelError:
                raise
            except Exception as exc:
                raise ModelError(f"could not convert the GGUF model {key}: {exc}") from exc
            if problem is None:
                write_manifest(final, _manifest(final)["source"])
            else:
                write_manifest(staged, source or {"key": key})
                os.replace(staged, final)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return final
