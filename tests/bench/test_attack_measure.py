"""benchmarks/serving/attack_measure.py: its gap statistics and report on canned data, and a reduced run of
every attack on the tiny pair (seconds of each) that leaves the victim, the normal and the ZeroMQ clients served."""

from __future__ import annotations

import json

from benchmarks.serving.attack_measure import PHASES, gap_stats, main, phase_labels, render


def test_gap_stats_count_only_the_gaps_within_the_window_and_never_across_streams():
    streams = [[0.0, 1.0, 1.5, 4.0], [10.0, 10.1, 10.3], [20.0]]
    stats = gap_stats(streams, 0.5, 11.0)  # 1.0 -> 1.5 -> 4.0 and 10.0 -> 10.1 -> 10.3; 4.0 -> 10.0 is no gap
    assert stats["gaps"] == 4 and stats["max_gap_s"] == 2.5 and stats["p99_gap_s"] == 2.5
    assert stats["p50_gap_s"] == round((0.2 + 0.5) / 2, 4)
    assert gap_stats(streams, 30.0, 40.0) == {"max_gap_s": None, "p50_gap_s": None, "p99_gap_s": None, "gaps": 0}


def test_phases_run_baseline_first_and_a_repeated_phase_again_under_a_numbered_label():
    assert phase_labels(["amplification"]) == [("baseline", "baseline"), ("amplification", "amplification")]
    assert phase_labels(["amplification", "baseline", "amplification", "amplification", "baseline"]) == [
        ("baseline", "baseline"), ("amplification", "amplification"), ("amplification_2", "amplification"),
        ("amplification_3", "amplification"), ("baseline_2", "baseline")]
    assert [label for label, _ in phase_labels(list(PHASES))] == list(PHASES)


def canned_phase(max_gap: float | None, **attack: object) -> dict:
    victim = {"max_gap_s": max_gap, "p50_gap_s": 0.002, "p99_gap_s": 0.01, "gaps": 100, "max_first_chunk_s": 0.02,
              "streams_ok": 9, "streams_wrong_text": 1, "streams_failed": 0, "failures": {}}
    return {"seconds": 20.0, "victim": victim, "normal_client": {"ok": 50, "HTTP 503": 2}, "zmq_client": {"ok": 51},
            "attack": attack, "rss_mb_after": 512.4, "alive": True}


def test_the_report_has_a_row_per_phase_the_rss_series_and_each_attacks_counts():
    results = {"command": "python benchmarks/serving/attack_measure.py", "commit": "abc1234", "cpu": "Some CPU",
               "elapsed_s": 300.0, "settings": {"grammar_cache_mb": 64, "max_grammar_mb": 8,
                                                "daemon_flags": ["--grammar-cache-mb", "64"]},
               "phases": {"baseline": canned_phase(None), "grammar_flood": canned_phase(
                   2.5, grammars=50, outcomes={"served": 40, "over cap": 10},
                   samples=[{"sent": 0, "rss_mb": 500.0, "compiled_mb": 0.0},
                            {"sent": 25, "rss_mb": 560.2, "compiled_mb": 63.5}])}}
    text = render(results)
    assert "| baseline | – | 2 ms | 10 ms | 100 | 20 ms | 9 / 1 / 0 | HTTP 503 2, ok 50 | ok 51 | 512 MiB |" in text
    assert "| grammar_flood | 2.50 s |" in text
    assert "| 25 | 560 MiB | 63.5 MiB |" in text and "over cap 10, served 40" in text
    assert '- grammar_flood: `{"grammars": 50, "outcomes": {"over cap": 10, "served": 40}}`' in text
    assert "abc1234" in text and "Some CPU" in text and "--grammar-cache-mb 64" in text


def test_a_reduced_run_of_every_attack_leaves_the_others_served(tmp_path, capsys):
    out = tmp_path / "attacks"
    results = main(["--out", str(out), "--phase-s", "1", "--slow-s", "2.5", "--after-s", "0.5", "--grammars", "4",
                    "--sample-every", "2", "--idle-connections", "200", "--slow-connections", "10",
                    "--attackers", "2", "--victim-tokens", "40", "--http-header-timeout", "1",
                    "--http-body-timeout", "1"])
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
    assert (out / "results.md").read_text() in capsys.readouterr().out
    phases = results["phases"]
    assert list(phases) == list(PHASES)
    for name, phase in phases.items():
        assert phase["alive"], name
        victim = phase["victim"]
        assert victim["streams_ok"] > 0 and victim["streams_wrong_text"] == 0 and victim["streams_failed"] == 0, name
        assert victim["gaps"] > 0, name
        assert phase["normal_client"].get("ok", 0) > 0 and phase["zmq_client"] == {"ok": phase["zmq_client"]["ok"]}
    assert [s["sent"] for s in phases["grammar_flood"]["attack"]["samples"]] == [0, 2, 4]
    idle = phases["idle_flood"]["attack"]
    assert idle["connections"] == 200 and idle["idle refused 503"] > 0
    slow = phases["slow_requests"]["attack"]
    assert slow["slow_head closed by server"] > 0 and slow["slow_body closed by server"] > 0
    assert phases["amplification"]["attack"]["replies"].get("ok", 0) > 0
    assert phases["extreme_sampling"]["attack"]["replies"].get("ok", 0) > 0
    assert results["daemon_exit_status"] == 0 and results["daemon_tracebacks"] == 0
