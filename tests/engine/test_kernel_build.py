"""fly_llm.model.kernels.build says it is compiling only when a kernel is not built yet."""

from __future__ import annotations

import logging
import platform
import shutil

import pytest

from fly_llm.model.kernels import build

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in {"x86_64", "amd64"} or not (shutil.which("c++") or shutil.which("g++")),
    reason="the kernels need an x86 CPU and a C++ compiler")


def test_a_built_kernel_is_loaded_without_a_compiling_line(caplog):
    assert build.load_extension("layer_ops") is not None  # built (or loaded) once for this process
    build.load_extension.cache_clear()
    caplog.set_level(logging.INFO, logger=build.__name__)
    assert build.load_extension("layer_ops") is not None
    assert "compiling" not in caplog.text


def test_a_dead_builders_leftover_lock_does_not_hang_the_next_load(tmp_path, monkeypatch):
    """A builder killed mid-build leaves torch's `lock` file; the next load must not wait on it forever
    (the daemon hung at model load in that state)."""
    (tmp_path / build.TORCH_BATON).write_text("")
    seen = {}

    def load(**kwargs):
        seen["baton left"] = (tmp_path / build.TORCH_BATON).exists()
        return "module"

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    assert build.compile_extension("fly_probe", tmp_path / "probe.cpp", tmp_path) == "module"
    assert seen == {"baton left": False}


def test_a_live_builders_turn_is_waited_for(tmp_path, monkeypatch):
    """While another process builds (it holds the turn), a load waits for it instead of building beside it."""
    import subprocess
    import sys
    import threading

    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys\n"
        f"f = open({str(tmp_path / 'build.flock')!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); sys.stdin.readline()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    loaded = threading.Event()
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: loaded.set())
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter = threading.Thread(target=build.compile_extension, args=("fly_probe", tmp_path / "p.cpp", tmp_path))
        waiter.start()
        assert not loaded.wait(1.0)  # blocked behind the live builder
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert loaded.wait(30)  # its turn came when the builder ended
        waiter.join(30)
    finally:
        holder.kill()
