"""benchmarks.forward.step_profile labels every matmul of a fused w4a8 model, including those fused layers
call through `project` instead of the module call."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import make_pair

from benchmarks.forward.step_profile import label_linears, profile_table
from fly_llm.decoding.cache import BatchKV
from fly_llm.model.kernels import w4a8
from fly_llm.model.quantization import quantize

CPU = torch.device("cpu")


@pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")
def test_every_matmul_of_a_fused_model_is_labelled_linear():
    target, _, _ = make_pair("llama", device="cpu")
    quantize(target, "w4a8", CPU)
    with torch.inference_mode():
        kv = BatchKV.prefill(target, list(range(8)), CPU)
        label_linears(target)
        table = profile_table(target, kv, context=8, width=1, rows=50)
    layers = target.config.num_hidden_layers
    per_forward = 4 * layers + 1  # q/k/v, o, gate/up, down per layer; the output head
    row = next(line for line in table.splitlines() if line.split() and line.split()[0] == "linear")
    assert str(5 * per_forward) in row.split()  # profile_table runs 5 forwards
