"""Fill-in-the-middle with the real embedded pair (Qwen2.5-Coder 1.5B target / 0.5B draft): its tokenizer's FIM
tokens are found, and the middle of a small Python function is plausible code that joins prefix and suffix.

Slow (a minute or more on a CPU once the model cache is built) and needs `fly-llm[models]`.
Run with `python -m pytest tests/engine/test_fim_real_slow.py -m slow -s`.
"""

from __future__ import annotations

import pytest

from support.device import TEST_DEVICE
from fly_llm.common.config import FLyConfig, ModelSpec, SamplingParams
from fly_llm.common.fim import Infill
from fly_llm.decoding.engine import FLyEngine
from fly_llm.model.pair import load_models

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CASES = [  # (prefix, suffix, what the middle must hold)
    ("def is_even(n: int) -> bool:\n    \"\"\"Whether n is even.\"\"\"\n    return ", "\n\n\nprint(is_even(4))\n",
     "% 2"),
    ("def add(a, b):\n    \"\"\"The sum of a and b.\"\"\"\n", "\n\n\nassert add(2, 3) == 5\n", "a + b"),
]


def test_the_embedded_target_fills_in_a_python_function():
    pair = load_models(ModelSpec(device=TEST_DEVICE), progress=False)
    engine = FLyEngine(pair.target, pair.tokenizer, pair.draft, FLyConfig())
    assert engine.fim is not None and engine.fim.style == "qwen" and engine.fim.file_sep is not None
    for i, (prefix, suffix, _) in enumerate(CASES):
        engine.add_request(str(i), engine.encode(infill=Infill(prefix=prefix, suffix=suffix)),
                           SamplingParams(max_tokens=32))
    texts = {str(i): "" for i in range(len(CASES))}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.new_text
    for i, (prefix, suffix, needed) in enumerate(CASES):
        middle = texts[str(i)]
        assert needed in middle, (prefix, middle)
        assert "<|" not in middle and "def " not in middle.split(needed)[0], middle  # the middle only, no new function
        compile(prefix + middle + suffix, "<fim>", "exec")  # prefix + middle + suffix is valid Python
