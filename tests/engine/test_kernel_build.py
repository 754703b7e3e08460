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
