"""The wheel ships code, not measurements: built with the project's own backend (hatchling, offline), it holds the
library, the daemon, the adapters and fly-bench's harness, and no benchmark results, scripts or data files."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 2 * 1024 * 1024  # ~0.3 MB today; the results alone were ~9 MB compressed
PACKAGES = ("fly_llm/", "fly_daemon/", "langchain_fly/", "llama_index/llms/fly/", "benchmarks/")
SOURCE_SUFFIXES = (".py", ".cpp")  # the kernels' C++ sources compile on first use


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip wheel .` would build, from the build backend directly (no network, no isolation)."""
    out = tmp_path_factory.mktemp("wheel")
    build = "import sys, hatchling.build as backend; print(backend.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(out)], cwd=ROOT, capture_output=True, text=True,
                          check=True, timeout=120)
    return out / done.stdout.split()[-1]


def names(wheel: Path) -> list[str]:
    """Every path in `wheel`."""
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_wheel_is_small(wheel: Path) -> None:
    assert wheel.stat().st_size < MAX_BYTES, f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB"


def test_wheel_holds_source_only(wheel: Path) -> None:
    files = [n for n in names(wheel) if ".dist-info/" not in n]
    assert not [n for n in files if "/results/" in n], "benchmark results in the wheel"
    assert not [n for n in files if not n.endswith(SOURCE_SUFFIXES)], "data files in the wheel"
    assert not [n for n in files if not n.startswith(PACKAGES)], "files outside the packages"


def test_wheel_has_fly_bench_but_not_the_scripts(wheel: Path) -> None:
    benchmarks = {n for n in names(wheel) if n.startswith("benchmarks/")}
    assert "benchmarks/harness/cli.py" in benchmarks
    assert all(n == "benchmarks/__init__.py" or n.startswith("benchmarks/harness/") for n in benchmarks), \
        sorted(benchmarks)
    with zipfile.ZipFile(wheel) as archive:
        entry_points = archive.read(next(n for n in archive.namelist() if n.endswith("entry_points.txt"))).decode()
    assert "fly-bench = benchmarks.harness.cli:main" in entry_points


def test_wheel_has_every_package(wheel: Path) -> None:
    files = names(wheel)
    for package in ("fly_llm/__init__.py", "fly_llm/model/kernels/w4a8.cpp", "fly_daemon/cli.py",
                    "langchain_fly/__init__.py", "llama_index/llms/fly/__init__.py"):
        assert package in files
