"""benchmarks/serving/server_side_by_side.py's pure parts: the decode rate, resuming parts, medians and ratios,
weight bytes per token from the servers' counters, each part's command line and the report's columns; the
interleaved run's rotation, schedule and paired ratios (benchmarks/serving/paired_ratios.py), and an
interleaved run end to end on fake servers."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace

import argparse
from pathlib import Path

import pytest

from benchmarks.serving import server_side_by_side as sbs
from benchmarks.serving.paired_ratios import pair_ratios, spread
from benchmarks.serving.server_side_by_side import (
    Live,
    Prompt,
    bytes_per_token,
    decode_rate,
    forwards,
    markdown,
    parse_args,
    pending,
    read_jsonl,
    rotation,
    schedule,
    start,
    summarize,
)


def row(server: str, prompt_id: str, kind: str, ttft: float, e2e: float, tokens: int = 31, text: str = "a",
        round_: int = 1, details: dict | None = None, position: int | None = None) -> dict:
    return {"round": round_, "server": server, "prompt_id": prompt_id, "kind": kind, "ttft_s": ttft,
            "decode_tokens_per_s": 0.0, "e2e_s": e2e, "completion_tokens": tokens, "text": text, "commit": "abc",
            "details": details, "position": position}


def part(server: str, target: int | None = 1000, draft: int | None = 0, speculates: bool = True, **more) -> dict:
    return {"server": server, "round": 1, "command": f"run {server}", "target_weight_bytes": target,
            "draft_weight_bytes": draft, "speculates": speculates, "activations": f"{server} precision",
            "llama_server": None, "log": None} | more


def test_decode_rate_counts_the_tokens_after_the_first_over_the_time_after_it():
    assert decode_rate(11, 1.0, 3.0) == 5.0
    assert decode_rate(9, 1.0, 3.0) == 4.0 and decode_rate(8, 1.0, 3.0) is None  # too short to time
    assert decode_rate(11, 2.0, 2.0) is None


def test_pending_skips_what_this_server_and_round_already_measured(tmp_path):
    prompts = [Prompt(p, "code", []) for p in ("a", "b", "c")]
    path = tmp_path / "rows.jsonl"
    assert read_jsonl(path) == []
    path.write_text("".join(json.dumps(r) + "\n" for r in
                            [row("fly", "a", "code", 1, 2), row("llamacpp", "b", "code", 1, 2)]))
    rows = read_jsonl(path)
    assert [p.prompt_id for p in pending(rows, "fly", 1, prompts)] == ["b", "c"]
    assert [p.prompt_id for p in pending(rows, "fly", 2, prompts)] == ["a", "b", "c"]


def test_summary_medians_per_prompt_over_rounds_then_over_prompts_and_ratios_to_llamacpp():
    rows = [row("llamacpp", "a", "code", 1.0, 4.0, text="x"), row("llamacpp", "b", "rag", 3.0, 6.0, tokens=2),
            row("fly", "a", "code", 0.5, 2.0, text="x"), row("fly", "a", "code", 0.5, 1.5, round_=2),
            row("fly", "b", "rag", 1.5, 2.0, tokens=2, text="y")]
    summary = summarize(rows)
    assert summary["llamacpp"]["all"] == {"ttft_s": 2.0, "decode_tokens_per_s": 10.0, "e2e_s": 5.0}
    assert summary["fly"]["code"] == {"ttft_s": 0.5, "decode_tokens_per_s": 25.0, "e2e_s": 1.75}
    assert summary["fly"]["rag"]["decode_tokens_per_s"] is None  # two tokens: too short to time
    assert summary["fly"]["all"] == {"ttft_s": 1.0, "decode_tokens_per_s": 25.0, "e2e_s": 1.875}
    assert summary["reference"] == "llamacpp" and summary["fly"]["vs_reference"]["all"]["decode_tokens_per_s"] == 2.5
    assert summary["fly"]["vs_reference"]["tokens_per_s_end_to_end"] == round(round(64 / 5.5, 2) / 3.3, 2)
    assert summary["fly"]["rounds"] == 2 and summary["same_text_as_reference"]["fly"] == "1/3"
    text = markdown(summary, {"cpu": "cpu", "commits_measured": ["abc"], "command": "cmd", "parts": {}})
    assert "| fly | 3 | 1.0 | 25.0 | 1.875 |" in text and "code" in text and "rag" in text


def test_the_sweeps_parts_resume_each_on_its_own(tmp_path):
    prompts = [Prompt(p, "code", []) for p in ("a", "b")]
    rows = [row("llama-server-draft-n8-p0.75", "a", "code", 1, 2), row("llama-server-draft-n8-p0.9", "a", "code", 1, 2),
            row("llama-server-draft-n8-p0.9", "b", "code", 1, 2)]
    assert [p.prompt_id for p in pending(rows, "llama-server-draft-n8-p0.75", 1, prompts)] == ["b"]
    assert pending(rows, "llama-server-draft-n8-p0.9", 1, prompts) == []
    assert len(pending(rows, "llama-server-draft-n16-p0.75", 1, prompts)) == 2
    assert parse_args(["--server", "llama-server-draft-n16-p0.5"]).server == "llama-server-draft-n16-p0.5"
    with pytest.raises(SystemExit):
        parse_args(["--server", "llama-server-draft-n3-p0.5"])  # not in the sweep


def test_forwards_come_from_llama_servers_timings_and_fly_daemons_stats():
    assert forwards(None) is None and forwards({}) is None
    assert forwards({"timings": {"predicted_n": 10}}) == (10, 0, 10)  # plain decoding: a forward per token
    assert forwards({"timings": {"predicted_n": 10, "draft_n": 12, "draft_n_accepted": 6}}) == (4, 12, 10)
    stats = {"rounds": 5, "drafted": 9, "emitted": 12, "draft_model_rounds": 3}
    assert forwards({"fly_stats": stats}) == (5, 9, 12)
    assert forwards({"fly_stats": stats | {"draft_model_rounds": 0}}) == (5, 0, 12)  # n-grams only: no draft forward


def test_bytes_per_token_weighs_each_forward_by_its_models_weights():
    drafted = [row("s", "a", "code", 1, 2, details={"timings": {"predicted_n": 10, "draft_n": 12, "draft_n_accepted": 6}}),
               row("s", "b", "code", 1, 2, details={"timings": {"predicted_n": 6, "draft_n": 4, "draft_n_accepted": 2}})]
    assert bytes_per_token(drafted, part("s", 1000, 100)) == round((8 * 1000 + 16 * 100) / 16)
    assert bytes_per_token(drafted, part("s", 1000, 0)) == 500  # n-gram drafts cost no weights
    assert bytes_per_token(drafted, part("s", 1000, None)) is None  # a draft model whose size is unknown
    assert bytes_per_token([row("s", "a", "code", 1, 2)], part("s", 1000, 0, speculates=False)) == 1000.0
    assert bytes_per_token([row("s", "a", "code", 1, 2)], part("s")) is None  # speculates, no counters
    assert bytes_per_token(drafted, part("s", None)) is None and bytes_per_token(drafted, None) is None


def test_report_has_bytes_activations_the_llama_server_reference_the_best_llamacpp_mode_and_its_build():
    timings = {"predicted_n": 31, "draft_n": 40, "draft_n_accepted": 20}
    rows = [row("llamacpp", "a", "code", 1.0, 4.0), row("llama-server", "a", "code", 0.5, 3.5, text="b"),
            row("llama-server-draft-n8-p0.75", "a", "code", 0.5, 2.0, details={"timings": timings}),
            row("llama-server-ngram-mod", "a", "code", 0.5, 3.0, details={"timings": timings}),
            row("fly", "a", "code", 0.4, 1.6, details={"fly_stats": {"rounds": 10, "drafted": 30, "emitted": 31,
                                                                    "draft_model_rounds": 9}})]
    build = {"version": "version: 0.5.0-dev", "build": "cmake_flags: -DGGML_AVX512=ON",
             "system_info": "system_info: n_threads = 2 | AVX512 = 1 |"}
    log = {"flash_attn": ["flash_attn = auto"], "slots": []}
    parts = [part("llama-server", 1000, 0, speculates=False, llama_server=build, log=log),
             part("llama-server-draft-n8-p0.75", 900, 100, llama_server=build, log=log),  # an earlier part
             part("llama-server-draft-n8-p0.75", 1000, 100, llama_server=build, log=log),
             part("llama-server-ngram-mod", 1000, 0, llama_server=build, log=log),
             part("llamacpp", 1000, 0, speculates=False), part("fly", 950, 300)]
    summary = summarize(rows, parts)
    assert summary["reference"] == "llama-server"
    assert summary["llama-server"]["bytes_per_token"] == 1000.0
    assert summary["llama-server-draft-n8-p0.75"]["bytes_per_token"] == round((11 * 1000 + 40 * 100) / 31)
    assert summary["llama-server-ngram-mod"]["bytes_per_token"] == round(11 * 1000 / 31)
    assert summary["fly"]["bytes_per_token"] == round((10 * 950 + 30 * 300) / 31)
    assert summary["fly"]["activations"] == "fly precision"
    assert summary["best_llamacpp"]["server"] == "llama-server-draft-n8-p0.75"  # the fastest decode of llama.cpp's
    assert summary["best_llamacpp"]["fly"]["all"]["e2e_s"] == 0.8
    assert summary["same_text_as_reference"] == {s: "0/1" if s != "llama-server" else "1/1" for s in
                                                 ("llamacpp", "llama-server", "llama-server-draft-n8-p0.75",
                                                  "llama-server-ngram-mod", "fly")}
    settings = {"cpu": "cpu", "commits_measured": ["abc"], "command": "cmd",
                "parts": {p["server"]: p for p in parts}}
    text = markdown(summary, settings)
    assert "| weight MB/token | activations | TTFT × llama-server |" in text
    assert "| llama-server | 1 | 0.5 | 10.0 | 3.5 | 8.86 | 0 | llama-server precision | 1.0 | 1.0 | 1.0 | 1.0 |" in text
    assert "Best llama.cpp mode by decode tok/s: llama-server-draft-n8-p0.75; FLy's decode × it" in text
    assert "- llama-server-draft-n8-p0.75: `run llama-server-draft-n8-p0.75` (flash_attn = auto)" in text
    assert text.count("llama-server: version: 0.5.0-dev") == 1  # one binary, said once
    assert "- build: cmake_flags: -DGGML_AVX512=ON" in text and "- system_info: n_threads = 2 | AVX512 = 1 |" in text


def test_each_part_starts_its_own_command(tmp_path):
    args = argparse.Namespace(server="llama-server-draft-n8-p0.75", llama_server=Path("/bin/llama-server"), threads=2,
                              n_ctx=4096, dtype="auto")
    _, cmd, log = start(args, Path("t.gguf"), Path("d.gguf"), tmp_path)
    assert cmd[:5] == ["/bin/llama-server", "-m", "t.gguf", "-md", "d.gguf"] and cmd[-2:] == ["-t", "2"]
    assert "--spec-draft-n-max" in cmd and log == tmp_path / "llama-server.log"
    args.server = "llamacpp-lookup"
    _, cmd, _ = start(args, Path("t.gguf"), None, tmp_path)
    assert cmd[1:3] == ["-m", "llama_cpp.server"] and cmd[-2:] == ["--draft_model", "prompt-lookup-decoding"]
    args.server = "target"
    _, cmd, log = start(args, Path("t.gguf"), None, tmp_path)
    assert cmd[-2:] == ["--stages", "''"] and log == tmp_path / "daemon.log"


def test_the_rotation_puts_every_server_in_every_position_evenly():
    servers = ["a", "b", "c", "d"]
    prompts = range(8)
    per_round = [Counter((s, rotation(servers, r, i).index(s)) for i in prompts for s in servers) for r in (1, 2, 3)]
    assert all(set(c.values()) == {2} and len(c) == 16 for c in per_round)  # each server twice in each position
    for i in prompts:  # over len(servers) rounds a prompt has each server in each position once
        assert {(s, rotation(servers, r, i).index(s)) for r in (1, 2, 3, 4) for s in servers} == \
            {(s, k) for s in servers for k in range(4)}
    assert sorted(rotation(servers, 2, 5)) == servers and rotation(servers, 1, 0) == servers
    firsts = Counter(rotation(["a", "b", "c"], r, i)[0] for r in (1, 2, 3) for i in range(3))  # 3 code prompts
    assert set(firsts.values()) == {3}


def test_the_schedule_skips_what_rows_hold_and_keeps_the_others_positions():
    prompts = [Prompt(p, "code", []) for p in ("p", "q")]
    full = schedule(["a", "b"], [prompts, prompts], [])
    assert [(r, p.prompt_id, order) for r, p, order in full] == [
        (1, "p", [(0, "a"), (1, "b")]), (1, "q", [(0, "b"), (1, "a")]),
        (2, "p", [(0, "b"), (1, "a")]), (2, "q", [(0, "a"), (1, "b")])]
    rows = [row("b", "p", "code", 1, 2, round_=2), row("a", "q", "code", 1, 2), row("b", "q", "code", 1, 2)]
    assert [(r, p.prompt_id, order) for r, p, order in schedule(["a", "b"], [prompts, prompts], rows)] == [
        (1, "p", [(0, "a"), (1, "b")]), (2, "p", [(1, "a")]), (2, "q", [(0, "a"), (1, "b")])]


def test_each_round_gets_its_own_prompts_of_every_kind(monkeypatch):
    monkeypatch.setattr(sbs, "load", lambda dataset, n: [SimpleNamespace(item_id=f"{dataset}{k}", messages=[])
                                                         for k in range(n)])
    rounds = sbs.round_prompts(3)
    assert [[p.kind for p in r] for r in rounds] == [["code"] * 3 + ["chat"] * 3 + ["rag"] * 2] * 3
    ids = [p.prompt_id for r in rounds for p in r]
    assert len(set(ids)) == 24 and [p.prompt_id for p in rounds[1]][:3] == ["humaneval1", "humaneval4", "humaneval7"]
    math = sbs.round_prompts(2, ("math", "chat"))
    assert [[(p.kind, p.prompt_id) for p in r] for r in math] == [
        [("chat", f"prose{k}") for k in (0, 2, 4)] + [("math", f"gsm8k{k}") for k in (0, 2, 4)],
        [("chat", f"prose{k}") for k in (1, 3, 5)] + [("math", f"gsm8k{k}") for k in (1, 3, 5)]]
    assert [p.kind for p in sbs.load_prompts(("math",))] == ["math"] * 3


def test_paired_ratios_divide_by_the_reference_on_the_same_prompt_and_round():
    rows = [row("llama-server", "a", "code", 1.0, 4.0, position=0), row("fly", "a", "code", 2.0, 3.5, position=1),
            row("llama-server", "a", "code", 3.0, 9.0, round_=2, position=1), row("fly", "a", "code", 3.0, 6.0, round_=2, position=0),
            row("llama-server", "b", "chat", 1.0, 4.0, position=0), row("fly", "b", "chat", 0.5, 1.0, position=1),
            row("llama-server", "c", "rag", 2.0, 2.5, tokens=2, position=0), row("fly", "c", "rag", 1.0, 1.5, tokens=2, position=1),
            row("fly", "d", "chat", 1.0, 2.0, position=1),  # the reference never answered d
            row("llama-server", "b", "chat", 9.0, 99.0, round_=3), row("fly", "b", "chat", 1.0, 2.0, round_=3)]  # parts: no pairs
    rated = [sbs.rated(r) for r in rows]
    assert pair_ratios(rated, "fly", "llama-server", "ttft_s") == [2.0, 1.0, 0.5, 0.5]
    assert pair_ratios(rated, "fly", "llama-server", "decode_tokens_per_s") == [2.0, 2.0, 6.0]  # rag: too short to time
    assert pair_ratios(rated, "fly", "llama-server", "ttft_s", "rag") == [0.5]
    assert spread([1.0, 2.0, 4.0]) | {"low": 0, "high": 0} == {"median": 2.0, "low": 0, "high": 0, "min": 1.0,
                                                             "max": 4.0, "pairs": 3}
    wide = spread([1.0, 2.0, 4.0])
    assert 1.0 <= wide["low"] <= 2.0 <= wide["high"] <= 4.0 and spread([1.3] * 5)["low"] == spread([1.3] * 5)["high"] == 1.3
    assert spread([]) is None
    summary = summarize(rows, reference="llama-server")
    assert summary["reference"] == "llama-server" and "llama-server" not in summary["paired"]
    assert summary["paired"]["fly"]["all"]["decode_tokens_per_s"]["median"] == 2.0
    assert summary["paired"]["fly"]["code"]["ttft_s"]["pairs"] == 2 and summary["paired"]["fly"]["rag"]["decode_tokens_per_s"] is None
    text = markdown(summary, {"cpu": "cpu", "commits_measured": ["abc"], "command": "cmd", "parts": {}})
    assert "## Paired ratios to llama-server" in text and "| fly | decode_tokens_per_s | 2.00 (" in text
    with pytest.raises(SystemExit, match="--reference target has no rows"):
        summarize(rows, reference="target")


def test_the_command_line_of_an_interleaved_run():
    args = parse_args(["--interleave", "llama-server", "fly", "--rounds", "2"])
    assert args.interleave == ["llama-server", "fly"] and args.reference == "llama-server" and args.rounds == 2
    assert parse_args(["--interleave", "llama-server", "fly", "--reference", "fly"]).reference == "fly"
    assert args.kinds == ["code", "chat", "rag"]
    assert parse_args(["--interleave", "fly", "--kinds", "math", "chat"]).kinds == ["math", "chat"]
    for bad in (["--interleave", "fly", "--server", "fly"], ["--interleave", "fly", "fly"],
                ["--interleave", "fly", "--reference", "target"], ["--interleave", "fly", "--rounds", "0"],
                ["--interleave", "nothing"], ["--interleave", "fly", "--kinds", "poetry"], []):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_an_interleaved_run_on_fake_servers_pairs_out_the_drift_and_resumes(tmp_path, monkeypatch):
    """Three fake servers whose speeds all drift together from one prompt to the next; fly decodes twice as
    fast as llama-server on every request. Each is started and warmed once, asked in rotation, and the paired
    decode ratio is exactly 2 while the drift spreads the per-server rates; a second run finds nothing to do."""
    prompts = [Prompt(f"p{i}", kind, [{"role": "user", "content": f"p{i}"}])
               for i, kind in enumerate(["code", "code", "chat", "rag"])]
    speed = {"llama-server": 1.0, "fly": 2.0, "target": 0.8}
    started, asked = [], []

    @contextmanager
    def fake_started(args, gguf, draft_gguf, workdir):
        started.append((args.server, workdir.name))
        yield Live(args.server, None, args.server, {}, [])

    def fake_stream_chat(client, model, messages, max_tokens, extra_body):
        drift = 1 + len(asked) // 3 % 4 / 4  # the same for the three answers to one prompt
        asked.append(model)
        return "answer", 0.5 * drift, 0.5 * drift + 3.0 * drift / speed[model], None

    @contextmanager
    def fake_files(args, servers):
        yield tmp_path / "t.gguf", None, tmp_path

    monkeypatch.setattr(sbs, "round_prompts", lambda rounds, kinds: [prompts] * rounds)
    monkeypatch.setattr(sbs, "started", fake_started)
    monkeypatch.setattr(sbs, "stream_chat", fake_stream_chat)
    monkeypatch.setattr(sbs, "model_files", fake_files)
    monkeypatch.setattr(sbs, "token_counter", lambda gguf: lambda text: 31)
    out = tmp_path / "out"
    argv = ["--interleave", "llama-server", "fly", "target", "--rounds", "3", "--out", str(out)]
    assert sbs.main(argv) == 0
    assert started == [("llama-server", "llama-server"), ("fly", "fly"), ("target", "target")]
    rows = read_jsonl(out / "rows.jsonl")
    assert len(rows) == 3 * 4 * 3 and all(r["others_cpu_s"] == 0.0 for r in rows)
    assert Counter((r["server"], r["position"]) for r in rows) == {(s, k): 4 for s in speed for k in range(3)}
    for i in range(0, len(rows), 3):  # each prompt of each round asked of every server back to back
        assert len({(r["prompt_id"], r["round"]) for r in rows[i:i + 3]}) == 1
        assert [r["position"] for r in rows[i:i + 3]] == [0, 1, 2]
    summary = json.loads((out / "results.json").read_text())["summary"]
    fly = summary["paired"]["fly"]["all"]["decode_tokens_per_s"]
    assert fly == {"median": 2.0, "low": 2.0, "high": 2.0, "min": 2.0, "max": 2.0, "pairs": 12}
    assert summary["paired"]["target"]["code"]["decode_tokens_per_s"]["median"] == 0.8
    assert summary["paired"]["fly"]["rag"]["ttft_s"]["median"] == 1.0
    rates = [r["decode_tokens_per_s"] for r in rows if r["server"] == "fly"]
    assert max(rates) / min(rates) > 1.5  # the drift, which the pairs cancel
    assert sbs.main(argv) == 0 and len(started) == 3 and len(read_jsonl(out / "rows.jsonl")) == 36
