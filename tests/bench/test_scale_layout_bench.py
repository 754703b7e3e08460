"""benchmarks.forward.scale_layout_bench times a model's published weights with their two-level scales and
without, and would stop if the two layouts ever gave different logits."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import make_pair

from benchmarks.forward import scale_layout_bench
from benchmarks.forward.scale_layout_bench import compare, layouts, streamed_bytes
from fly_llm.decoding.cache import BatchKV
from fly_llm.model.kernels import w4a8
from fly_llm.model.quantization import quantize

CPU = torch.device("cpu")
SIZE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def _published(target: torch.nn.Module) -> dict[str, w4a8.SuperBlockWeight]:
    """Every MLP projection's weight as a two-level Q4_K-like weight (the rest is rounded from float)."""
    found = {}
    for name, module in target.named_modules():
        if name.endswith(("gate_proj", "up_proj", "down_proj")):
            n, k = module.weight.shape
            generator = torch.Generator().manual_seed(len(found))
            found[name] = w4a8.SuperBlockWeight(
                torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator),
                (torch.rand(n, k // 256, generator=generator) * 2**-8).half(),
                (torch.rand(n, k // 256, generator=generator) * 2**-8).half(),
                torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=generator),
                torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=generator))
    return found


@pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")
def test_the_layouts_are_compared_side_by_side_and_must_agree(monkeypatch):
    target, _, _ = make_pair("llama", device="cpu", **SIZE)
    quantize(target, "w4a8", CPU, published=_published(target))
    two, one = layouts(target)
    assert sum(p.levels is not None for p in two.values()) == target.config.num_hidden_layers * 2  # gate/up, down
    assert streamed_bytes(two) < streamed_bytes(one)
    with torch.inference_mode():
        kv = BatchKV.prefill(target, list(range(8)), CPU)
        times = compare(target, kv, context=8, width=2, rounds=2)
        assert {name: len(t) for name, t in times.items()} == {"two levels": 2, "one level": 2}
        assert all(module.packed is packed for module, packed in two.items())  # left as loaded
        module = next(m for m, p in two.items() if p.levels is not None)
        plain = one[module]  # a per-block twin that no longer matches the two levels
        one[module] = w4a8.PackedWeight(plain.q, plain.d * 2, plain.m, plain.n)
        monkeypatch.setattr(scale_layout_bench, "layouts", lambda model: (two, one))
        with pytest.raises(AssertionError, match="different logits"):
            compare(target, kv, context=8, width=1, rounds=1)
