"""benchmarks/serving/llama_server.py: the command line of each llama-server mode, what the binary says about
its build (from a stand-in binary and a canned log), and the weight bytes a forward of a GGUF reads."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serving import llama_server
from benchmarks.serving.llama_server import MODES, command, lines_with, log_facts, probe, weight_bytes

BIN = Path("/opt/llama/llama-server")
TAIL = ["--host", "127.0.0.1", "--port", "8080", "-t", "2"]

CANNED_LOG = """\
0.00.000.997 I srv  llama_server: initializing ...
0.00.007.424 I cmn  common_param: common_params_print_info: build 1 (0c1e570) with GNU 12.2.0 for Linux x86_64
0.00.007.617 I cmn  common_param: system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 | AVX512 = 1 |\x20
0.00.007.628 I srv  llama_server: n_parallel is set to auto, using n_parallel = 4 and kv_unified = true
0.00.013.411 I cmn          init: llama threadpool init, n_threads = 2
0.00.016.397 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 512, kv_unified = 'true'
0.00.016.397 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 512, kv_unified = 'true'
"""


def test_plain_llama_server_keeps_every_default_but_the_address_and_threads():
    assert command(BIN, MODES["llama-server"], Path("t.gguf"), None, 8080, 2) == [str(BIN), "-m", "t.gguf", *TAIL]


def test_the_draft_modes_draft_with_the_draft_gguf_and_the_sweep_sets_n_max_and_p_min():
    assert command(BIN, MODES["llama-server-draft"], Path("t.gguf"), Path("d.gguf"), 8080, 2) == [
        str(BIN), "-m", "t.gguf", "-md", "d.gguf", "--spec-type", "draft-simple", *TAIL]
    assert command(BIN, MODES["llama-server-draft-n8-p0.75"], Path("t.gguf"), Path("d.gguf"), 8080, 2) == [
        str(BIN), "-m", "t.gguf", "-md", "d.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "8",
        "--spec-draft-p-min", "0.75", *TAIL]
    with pytest.raises(ValueError, match="draft model"):
        command(BIN, MODES["llama-server-draft"], Path("t.gguf"), None, 8080, 2)


def test_the_sweep_is_every_n_max_with_every_p_min_each_a_part_of_its_own():
    sweep = [name for name in MODES if name.startswith("llama-server-draft-")]
    assert sweep == [f"llama-server-draft-n{n}-p{p}" for n in (4, 8, 16) for p in ("0.5", "0.75", "0.9")]
    assert all(MODES[name].draft for name in sweep)


def test_the_ngram_modes_need_no_draft_file():
    for kind in llama_server.NGRAM_TYPES:
        mode = MODES[f"llama-server-{kind}"]
        assert not mode.draft
        assert command(BIN, mode, Path("t.gguf"), None, 8080, 2) == [str(BIN), "-m", "t.gguf", "--spec-type", kind, *TAIL]
    assert len(MODES) == 1 + 1 + 9 + len(llama_server.NGRAM_TYPES)


def test_log_lines_are_kept_from_the_needle_on_once_each():
    assert lines_with(CANNED_LOG, "system_info:") == [
        "system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 | AVX512 = 1 |"]
    assert log_facts(CANNED_LOG) == {
        "flash_attn": ["flash_attn = auto, on (no 'Flash Attention not supported')"],
        "slots": ["n_slots = 4, n_ctx_slot = 512, kv_unified = 'true'"], "threads": ["threadpool init, n_threads = 2"]}
    off = "0.01.000.000 W resolve_fused_ops: Flash Attention not supported, set to disabled\n"
    assert log_facts(CANNED_LOG + off)["flash_attn"] == ["Flash Attention not supported, set to disabled"]


def fake_binary(directory: Path) -> Path:
    """A stand-in llama-server: its version for --version, else the start of its trace log and a failed load."""
    path = directory / "llama-server"
    log = CANNED_LOG.replace("\\", "\\\\").replace("'", "'\\''")
    path.write_text("#!/bin/sh\n"
                    'if [ "$1" = "--version" ]; then echo "version: 0.5.0-dev (build 1, commit 0c1e570)" >&2; '
                    'echo "built with GNU 12.2.0 for Linux x86_64" >&2; exit 0; fi\n'
                    f"printf '%s' '{log}'\necho \"failed to load model $6\" >&2\nexit 1\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (directory / "build-info.txt").write_text("source: llama-cpp-python==0.3.36 sdist\ncmake_flags: -DGGML_NATIVE=OFF\n")
    return path


def test_probe_records_the_version_build_flags_and_system_info(tmp_path):
    info = probe(fake_binary(tmp_path), threads=2)
    assert info == {"version": "version: 0.5.0-dev (build 1, commit 0c1e570) built with GNU 12.2.0 for Linux x86_64",
                    "build": "source: llama-cpp-python==0.3.36 sdist; cmake_flags: -DGGML_NATIVE=OFF",
                    "system_info": "system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 | AVX512 = 1 |"}


def write_gguf(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_forward_reads_every_weight_but_the_embedding_table_unless_the_table_is_the_head(tmp_path):
    embd, block, head = (np.zeros(shape, np.float32) for shape in ((64, 8), (8, 8), (64, 8)))
    tied = write_gguf(tmp_path / "tied.gguf", {"token_embd.weight": embd, "blk.0.ffn_up.weight": block})
    assert weight_bytes(tied) == embd.nbytes + block.nbytes
    untied = write_gguf(tmp_path / "untied.gguf",
                        {"token_embd.weight": embd, "blk.0.ffn_up.weight": block, "output.weight": head})
    assert weight_bytes(untied) == block.nbytes + head.nbytes


def tiny_ggufs(directory: Path) -> tuple[Path, Path]:
    """A tiny random target and its noisy draft as float32 GGUF files."""
    from support.tiny_models import make_pair, write_tiny_gguf

    target, draft, tokenizer = make_pair(device="cpu")
    return (write_tiny_gguf(directory / "tiny.gguf", target, tokenizer),
            write_tiny_gguf(directory / "draft.gguf", draft, tokenizer))


needs_binary = pytest.mark.skipif(not llama_server.LLAMA_SERVER.exists(), reason="llama-server is not built here")


@pytest.mark.slow
@needs_binary
def test_the_real_binary_takes_every_mode_and_answers_through_the_same_client(tmp_path):
    """The built llama-server accepts each mode's flags, and two tokens of a tiny model come back through the
    openai client with its `timings`."""
    import openai

    from benchmarks.serving.processes import serve
    from benchmarks.serving.server_side_by_side import stream_chat
    from benchmarks.serving.webui_check import free_port

    for mode in MODES.values():  # a model that is not there: the flags are parsed, then loading fails
        cmd = command(llama_server.LLAMA_SERVER, mode, tmp_path / "none.gguf", tmp_path / "none.gguf", free_port(), 2)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert "failed to load model" in out.stdout + out.stderr, (mode.name, out.stderr[-2000:])
    gguf, draft_gguf = tiny_ggufs(tmp_path)
    port = free_port()
    with serve(command(llama_server.LLAMA_SERVER, MODES["llama-server-draft-n4-p0.5"], gguf, draft_gguf, port, 2), port,
               tmp_path / "llama-server.log") as (url, model):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        _, first, end, details = stream_chat(client, model, [{"role": "user", "content": "hi"}], 2, {})
    assert first <= end and details["timings"]["predicted_n"] <= 2
    facts = log_facts((tmp_path / "llama-server.log").read_text())
    assert facts["slots"] and facts["threads"] == ["threadpool init, n_threads = 2"]
    assert probe(llama_server.LLAMA_SERVER, 2)["system_info"].startswith("system_info: n_threads = 2")


@pytest.mark.slow
@needs_binary
def test_a_draft_part_then_the_report_on_a_tiny_pair(tmp_path, monkeypatch):
    """server_side_by_side's part on the real binary, end to end: rows with llama-server's counters, the part's
    record with its build, and the report's bytes per token."""
    from benchmarks.serving import server_side_by_side as sbs

    gguf, draft_gguf = tiny_ggufs(tmp_path)
    prompts = [sbs.Prompt(f"p{i}", "code", [{"role": "user", "content": f"count to {i}"}]) for i in range(2)]
    monkeypatch.setattr(sbs, "load_prompts", lambda kinds: prompts)
    out = tmp_path / "out"
    part = ["--server", "llama-server-draft-n4-p0.5", "--target", str(gguf), "--draft", str(draft_gguf),
            "--max-tokens", "4", "--out", str(out)]
    assert sbs.main(part) == 0 and sbs.main(part) == 0  # the second finds nothing pending
    rows = sbs.read_jsonl(out / "rows.jsonl")
    assert [r["prompt_id"] for r in rows] == ["p0", "p1"] and all(r["details"]["timings"] for r in rows)
    (record,) = sbs.read_jsonl(out / "parts.jsonl")
    assert record["command"].split()[1:7] == ["-m", str(gguf), "-md", str(draft_gguf), "--spec-type", "draft-simple"]
    assert record["target_weight_bytes"] == weight_bytes(gguf) and record["draft_weight_bytes"] == weight_bytes(draft_gguf)
    assert record["llama_server"]["version"].startswith("version:") and record["log"]["slots"]
    assert sbs.main(["--report", "--out", str(out)]) == 0
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert summary["llama-server-draft-n4-p0.5"]["bytes_per_token"] is not None
    assert "llama-server: version:" in (out / "results.md").read_text()
