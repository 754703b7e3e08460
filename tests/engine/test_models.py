"""Model loading on tiny local models: directories, GGUF files, the cache, checksums, vocabularies."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from support.tiny_models import make_pair, make_tokenizer, save_tiny_pair, write_tiny_gguf

from fly_llm.common.config import FLyConfig, ModelSpec, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from fly_llm.model.embedded import DRAFT, EmbeddedModel, assemble, part_paths
from fly_llm.common.errors import ModelError
from fly_llm.model.cache import CACHE_DTYPE, MANIFEST, cache_problem, cached_conversion
from fly_llm.model.pair import context_window, load_models, resolve_dtype

PROBE = "def add(a, b):\n    return a + b  # the quick brown fox<|im_end|>"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A private FLY_CACHE_DIR so tests never touch the user's cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FLY_CACHE_DIR", str(root))
    return root


def test_load_local_dir(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    loaded = load_models(ModelSpec(target=str(target_dir), draft=str(draft_dir), dtype="float32", device="cpu"),
                         progress=False)
    assert loaded.draft is not None and loaded.draft_name == str(draft_dir)
    assert loaded.dtype == torch.float32 and loaded.device == torch.device("cpu")
    assert loaded.context_window == 512
    assert not loaded.target.training and not loaded.draft.training
    # No Hub kernels: transformers would download them at load time (on CUDA), network at run time.
    assert not loaded.target.use_kernels and not loaded.draft.use_kernels
    reference = make_tokenizer()
    assert loaded.tokenizer.encode(PROBE) == reference.encode(PROBE)
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_draft_none_means_ngram_only(tiny_pair_dirs):
    target_dir, _ = tiny_pair_dirs
    for draft in (None, "none", "None"):
        loaded = load_models(ModelSpec(target=str(target_dir), draft=draft, device="cpu"), progress=False)
        assert loaded.draft is None and loaded.draft_name is None


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="not a model directory"):
        load_models(ModelSpec(target=str(tmp_path / "nowhere"), device="cpu"), progress=False)
    with pytest.raises(ModelError, match="GGUF file not found"):
        load_models(ModelSpec(target=str(tmp_path / "x.gguf"), device="cpu"), progress=False)


def test_vocabulary_mismatch_is_refused(tiny_pair_dirs, tmp_path):
    target_dir, draft_dir = tiny_pair_dirs
    other = tmp_path / "other_draft"
    shutil.copytree(draft_dir, other)
    make_tokenizer(vocab_size=300).save_pretrained(other)  # a different BPE, same embedding size
    with pytest.raises(ModelError, match="does not share the target"):
        load_models(ModelSpec(target=str(target_dir), draft=str(other), device="cpu"), progress=False)


def test_dtype_auto():
    assert resolve_dtype("auto", torch.device("cpu")) in (torch.bfloat16, torch.float32)
    assert resolve_dtype("float64", torch.device("cpu")) == torch.float64


def test_context_window_is_capped():
    target, _, _ = make_pair()
    target.config.max_position_embeddings = 1_000_000
    assert context_window(target) == 32_768


def test_gguf_is_converted_once_and_matches_the_weights(tmp_path, cache_dir):
    target, _, tokenizer = make_pair(device="cpu")  # compared with the CPU-loaded conversion
    path = write_tiny_gguf(tmp_path / "tiny.gguf", target, tokenizer)
    spec = ModelSpec(target=str(path), draft="none", dtype="float32", device="cpu", target_quantization="none")
    loaded = load_models(spec, progress=False)
    assert path.exists()  # the user's file is left alone
    expected = {k: v.to(CACHE_DTYPE).float() for k, v in target.state_dict().items()}
    got = loaded.target.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert loaded.tokenizer.encode(PROBE) == tokenizer.encode(PROBE)
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    assert loaded.tokenizer.chat_template == tokenizer.chat_template
    (cached,) = [p for p in cache_dir.iterdir() if not p.name.startswith(".")]
    assert cache_problem(cached) is None
    stamp = (cached / "model.safetensors").stat().st_mtime_ns

    load_models(spec, progress=False)  # reused, not rebuilt
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp


def test_corrupted_cache_is_detected_and_rebuilt(tmp_path):
    root = tmp_path / "cache"
    target, _, tokenizer = make_pair()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", target, tokenizer)
    built = cached_conversion(root, "tiny", lambda _: path, progress=False)
    weights = built / "model.safetensors"
    with open(weights, "r+b") as f:  # flip bytes in the safetensors header
        f.write(b"\0" * 16)
    assert "changed" in cache_problem(built)
    rebuilt = cached_conversion(root, "tiny", lambda _: path, progress=False)
    assert rebuilt == built and cache_problem(rebuilt) is None

    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 10)
    assert "bytes, expected" in cache_problem(built)
    (built / MANIFEST).unlink()  # e.g. a build that died before finishing
    assert "no manifest" in cache_problem(built)
    assert cache_problem(cached_conversion(root, "tiny", lambda _: path, progress=False)) is None


def test_failed_conversion_leaves_no_cache(tmp_path):
    root = tmp_path / "cache"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ModelError, match="could not convert"):
        cached_conversion(root, "bad", lambda _: bad, progress=False)
    assert not (root / "bad").exists() and not list(root.glob(".tmp-*"))
    assert bad.read_bytes() == b"not a gguf file"


def _fake_parts(tmp_path: Path, chunks: list[bytes]) -> list[Path]:
    paths = []
    for i, chunk in enumerate(chunks, 1):
        path = tmp_path / f"part{i:02d}.bin"
        path.write_bytes(chunk)
        paths.append(path)
    return paths


def test_assembly_joins_in_order_and_verifies(tmp_path):
    chunks = [b"alpha-", b"beta-", b"gamma"]
    parts = _fake_parts(tmp_path, chunks)
    good = hashlib.sha256(b"".join(chunks)).hexdigest()
    out = assemble(parts, tmp_path / "joined.gguf", 16, good, progress=False)
    assert out.read_bytes() == b"alpha-beta-gamma"

    with pytest.raises(ModelError, match="sha256") as err:
        assemble(parts, tmp_path / "bad.gguf", 16, "0" * 64, progress=False)
    assert "pip install" in str(err.value)
    assert not (tmp_path / "bad.gguf").exists()
    assert [p.read_bytes() for p in parts] == chunks  # nothing of the user's is touched

    with pytest.raises(ModelError, match="add up to 16 bytes, expected 17"):
        assemble(parts, tmp_path / "short.gguf", 17, good, progress=False)


def test_missing_parts_name_the_pip_command():
    ghost = EmbeddedModel(name="ghost", distribution="fly-llm-no-such-part", version="1.0", parts=2,
                          size=1, sha256="0" * 64)
    with pytest.raises(ModelError, match="missing fly-llm-no-such-part1==1.0, fly-llm-no-such-part2==1.0") as err:
        part_paths(ghost)
    assert "pip install" in str(err.value)


@pytest.mark.skipif(importlib.util.find_spec(DRAFT.module(1)) is None, reason="fly-llm[models] not installed")
def test_embedded_parts_are_installed():
    parts = part_paths(DRAFT)
    assert [p.name for p in parts] == [f"part{i:02d}.bin" for i in range(1, 7)]
    assert sum(p.stat().st_size for p in parts) == DRAFT.size


def test_save_tiny_pair_roundtrip_has_shared_vocab(tmp_path):
    target_dir, draft_dir = save_tiny_pair(tmp_path, "qwen2")
    loaded = load_models(ModelSpec(target=str(target_dir), draft=str(draft_dir), device="cpu"), progress=False)
    assert loaded.draft is not None
