"""benchmarks.engine.verify_ab times a commit's verify beside this tree's on the same sampling rounds."""

from __future__ import annotations

from benchmarks.engine.verify_ab import main
from support.git_checkout import needs_git


@needs_git
def test_both_versions_are_timed_on_every_shape(tmp_path):
    assert main(["--base", "HEAD", "--vocab", "50", "--k", "2", "--batches", "1", "3", "--top-ps", "1.0", "0.5",
                 "--calls", "2", "--threads", "1", "--out", str(tmp_path)]) == 0
    rows = [line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 4 and all(len(row.split("|")) == 6 for row in rows)
