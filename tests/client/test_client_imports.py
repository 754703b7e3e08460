"""The client side imports without torch or transformers (docs/design.md §2.2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CLIENT_MODULES = ["fly_llm.client", "fly_llm.common.protocol", "fly_llm.common.config", "fly_llm.common.errors",
                  "fly_llm.common.stats", "fly_llm.common.endpoints", "fly_llm.decoding.text"]


def test_client_modules_import_with_torch_hidden():
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys

        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "accelerate"):
                    raise ImportError(f"{{name}} is hidden in this test")
                return None

        sys.meta_path.insert(0, Hide())
        for name in {CLIENT_MODULES!r}:
            importlib.import_module(name)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
        assert not loaded, loaded
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
