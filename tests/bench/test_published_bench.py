"""benchmarks.forward.published_bench: the Q4_K-only reading keeps exactly the published Q4_K weights, and two
models' forwards are timed side by side (also what benchmarks.forward.activation_bench runs)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from support.tiny_models import make_pair

from benchmarks.forward.published_bench import Q4KOnly, compare, streamed_bytes
from fly_llm.model.kernels import w4a8
from fly_llm.model.kernels.gguf_blocks import PublishedWeights, save_published
from fly_llm.model.quantization import quantize

SIZE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def test_q4k_only_keeps_the_q4k_weights_alone(tmp_path):
    rng = np.random.default_rng(0)
    blocks = {"a": (T.Q4_K, torch.from_numpy(rng.integers(0, 256, (2, 144), dtype=np.uint8))),
              "b": (T.Q8_0, torch.from_numpy(rng.integers(0, 256, (2, 34 * 8), dtype=np.uint8)))}
    save_published(blocks, tmp_path / "p.safetensors")
    only = Q4KOnly(PublishedWeights(tmp_path / "p.safetensors"))
    assert list(only) == ["a"] and len(only) == 1 and isinstance(only["a"], w4a8.SuperBlockWeight)
    with pytest.raises(KeyError):
        only["b"]


@pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")
def test_two_models_are_timed_taking_turns():
    target, _, _ = make_pair("llama", device="cpu", **SIZE)
    other = copy.deepcopy(target)
    for model in (target, other):
        quantize(model, "w4a8", torch.device("cpu"))
    assert streamed_bytes(target) == streamed_bytes(other) > 0
    with torch.inference_mode():
        times, same = compare({"one": target, "other": other}, context=20, width=3, rounds=4)
    assert {name: len(t) for name, t in times.items()} == {"one": 4, "other": 4}  # warm-up rounds left out
    assert same == 1.0  # the same model picks the same tokens
