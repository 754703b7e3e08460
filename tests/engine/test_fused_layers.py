"""fly_llm.model.fused_layers: q/k/v and gate/up of a W4A8 model as one matmul each give the unfused
model's logits bit for bit (a prefill, then a 3-token forward on the cache)."""

from __future__ import annotations

import copy

import pytest
import torch
from support.tiny_models import make_pair

from fly_llm.model import quantization
from fly_llm.decoding.cache import BatchKV
from fly_llm.model.fused_layers import FusedW4A8
from fly_llm.model.kernels import w4a8
from fly_llm.model.quantization import quantize

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        kv = BatchKV.prefill(model, ids[:-3].tolist(), CPU)
        return kv.forward(model, ids[None, -3:], logits_to_keep=3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_model_gives_the_unfused_models_logits_bit_for_bit(arch, dtype, monkeypatch):
    target, _, tokenizer = make_pair(arch, dtype=dtype, device="cpu")
    unfused = copy.deepcopy(target)
    with monkeypatch.context() as patch:
        patch.setattr(quantization, "fuse", lambda model: 0)
        quantize(unfused, "w4a8", CPU)
    quantize(target, "w4a8", CPU)
    fused = [m for m in target.modules() if isinstance(m, FusedW4A8)]
    assert len(fused) == 2 * target.config.num_hidden_layers  # q/k/v and gate/up of every layer
    assert not any(isinstance(m, FusedW4A8) for m in unfused.modules())
    ids = torch.tensor(tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n"))
    assert torch.equal(_logits(target, ids), _logits(unfused, ids))


def test_other_schemes_are_not_fused():
    target, _, _ = make_pair("qwen2", device="cpu")
    if quantization.int8_available():
        quantize(target, "int8", CPU)
    assert not any(isinstance(m, FusedW4A8) for m in target.modules())
