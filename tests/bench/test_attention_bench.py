"""benchmarks.forward.attention_bench times the row attention op beside a baseline source and stops if they differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.forward import attention_bench
from fly_llm.model.kernels import row_attention

pytestmark = pytest.mark.skipif(not row_attention.available(), reason="the row attention op cannot run here")
SOURCE = Path(row_attention.__file__).with_suffix(".cpp")


@pytest.fixture(autouse=True)
def keep_threads():
    """main() sets torch's thread count: restore it for the tests after these."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_baseline_built_from_the_same_source_agrees_and_is_reported(tmp_path):
    out = tmp_path / "attention.md"
    assert attention_bench.main(["--baseline", str(SOURCE), "--contexts", "40", "300", "--queries", "1", "5",
                                 "--rounds", "2", "--out", str(out)]) == 0
    report = out.read_text()
    assert "| 300 | 5 |" in report and "current / baseline" in report and "outputs equal" in report


def test_ops_that_differ_stop_the_run():
    def shifted(q, k, v, mask, scale):
        return row_attention.attention(q, k, v, mask, scale) + 1

    with pytest.raises(SystemExit, match="differ at context 40, 3 queries"):
        attention_bench.compare({"current": row_attention.attention, "other": shifted}, 40, 3, rounds=1)


def test_without_a_baseline_only_the_current_op_is_timed(capsys):
    assert attention_bench.main(["--contexts", "20", "--queries", "2", "--rounds", "1", "--threads", "1"]) == 0
    assert "| 20 | 2 |" in capsys.readouterr().out


def test_forwards_swap_the_op_and_stop_if_the_logits_differ(monkeypatch):
    from support.tiny_models import make_pair

    from fly_llm.decoding.cache import BatchKV
    from fly_llm.model.attention import use_row_attention

    target, _, _ = make_pair("llama", device="cpu")
    use_row_attention(target)
    kv = BatchKV.prefill(target, list(range(30)), torch.device("cpu"))
    op = row_attention._ops()
    monkeypatch.setattr(row_attention, "_ops", row_attention._ops)  # the helper swaps it: restored after the test
    medians = attention_bench._forward_medians(target, kv, 30, 3, {"current": op, "baseline": op}, rounds=2)
    assert set(medians) == {"current", "baseline"} and kv.lengths == [30]

    class Shifted:  # an op module whose outputs are off by one
        @staticmethod
        def attention(*args):
            return op.attention(*args) + 1

    with pytest.raises(SystemExit, match="logits differ at context 30, width 3"):
        attention_bench._forward_medians(target, kv, 30, 3, {"current": op, "baseline": Shifted}, rounds=1)
