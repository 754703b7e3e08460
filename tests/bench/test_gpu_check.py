"""benchmarks/gpu_check.sh runs on a machine without a GPU: it skips every cuda step and exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run benchmarks/gpu_check.sh itself")
def test_gpu_check_skips_cuda_cleanly_without_a_gpu(tmp_path):
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=240, env={"PATH": "/usr/bin:/bin", "OUT_DIR": str(tmp_path),
                                           "PYTHON": sys.executable})
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.stdout[run.stdout.index("== gpu_check summary"):]
    assert "cuda: skipped (no CUDA device" in summary and "FAILED" not in summary
