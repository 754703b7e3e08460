"""benchmarks.harness.compare_parts: paired scores, flips and identical answers of parts from different runs."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness import compare_parts


def _part(path, passed: dict[str, bool], tokens: dict[str, list[int]], loose: dict[str, int] | None = None):
    rows = [{"item_id": i, "passed": p, "tokens": len(tokens[i]), "hit_limit": False, "token_ids": tokens[i],
             "text": "", "stats": {"accepted_loose": (loose or {}).get(i, 0)}} for i, p in passed.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_parts_are_compared_on_their_common_items(tmp_path, capsys):
    old = _part(tmp_path / "old.jsonl", {"a": True, "b": True, "c": False, "d": False},
                {"a": [1], "b": [2], "c": [3], "d": [4, 4]})
    new = _part(tmp_path / "new.jsonl", {"a": True, "b": False, "c": True, "d": True, "e": True},
                {"a": [1], "b": [9], "c": [8], "d": [4, 4], "e": [5]})
    assert compare_parts.main([f"old={old}", f"new={new}", "--out", str(tmp_path / "t.md")]) == 0
    table = (tmp_path / "t.md").read_text()
    assert "4 items in every part" in table  # e is in one part only
    old_row, row = table.splitlines()[4:6]
    assert old_row.startswith("| old | 50.0% [") and old_row.endswith("| – | – | – | – | 1 |")
    assert row.startswith("| new | 75.0% [") and "| 1 / 2 | 1.00 | 50.0% | 2 | 1 |" in row  # b fell, c and d rose


def test_answers_that_differ_without_a_loose_token_are_counted(tmp_path):
    """A part that kept a draft token by FLy's rule may differ there; any other difference is numerics."""
    target = _part(tmp_path / "t.jsonl", {"a": True, "b": True, "c": True}, {"a": [1], "b": [2], "c": [3]})
    fly = _part(tmp_path / "f.jsonl", {"a": True, "b": True, "c": True}, {"a": [1], "b": [7], "c": [8]},
                loose={"b": 1})
    assert compare_parts.main([f"target={target}", f"fly={fly}", "--out", str(tmp_path / "t.md")]) == 0
    row = (tmp_path / "t.md").read_text().splitlines()[5]
    assert row.startswith("| fly |") and "| 0 / 0 | 1.00 | 33.3% | 1 |" in row  # c differs with no loose token


def test_a_missing_part_file_is_named(tmp_path, capsys):
    one = _part(tmp_path / "one.jsonl", {"a": True}, {"a": [1]})
    with pytest.raises(SystemExit):
        compare_parts.main([f"one={one}", f"a = b={one}"])
    assert "no part file" in capsys.readouterr().err


def test_parts_without_common_items_are_refused(tmp_path):
    one = _part(tmp_path / "one.jsonl", {"a": True}, {"a": [1]})
    two = _part(tmp_path / "two.jsonl", {"b": True}, {"b": [1]})
    with pytest.raises(ValueError, match="no item in common"):
        compare_parts.main([f"one={one}", f"two={two}"])
    with pytest.raises(SystemExit):
        compare_parts.main([str(one)])
