"""What the CPU is (fly_llm.model.kernels.cpu): its model name, the one reader every caller uses."""

from __future__ import annotations

from pathlib import Path

from fly_llm.model.kernels import cpu
from fly_llm.model.kernels.cpu import cpu_model


def test_the_cpu_model_is_the_model_name_line_where_cpuinfo_has_one():
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text(encoding="utf-8").splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    model = cpu_model()
    assert isinstance(model, str) and model
    if names and names[0]:
        assert model == names[0]


def test_without_cpuinfo_or_platform_the_cpu_model_says_it_is_unknown(monkeypatch):
    monkeypatch.setattr(cpu, "_cpuinfo_line", lambda key: "")
    monkeypatch.setattr(cpu.platform, "processor", lambda: "")
    assert cpu_model.__wrapped__() == "unknown CPU"
