"""fly_llm.model.fused_layers: q/k/v and gate/up of a W4A8 model as one matmul each, and the layer's
small ops as native calls (fly_llm.model.kernels.layer_ops). With those ops' torch twins the fused model
gives the unfused model's logits bit for bit (a prefill, then a 3-token forward on the cache); with the
native ops within float32's last bits (1e-3 on logits of ~16, room for an int8 activation rounding
to flip) or a bf16 step (0.25 on logits in [16, 32)); exact mode reproduces the fused model's own
greedy output token for token; the lean model forward (all layers fused) gives transformers' model
forward's logits bit for bit, in a ragged batch with holes too."""

from __future__ import annotations

import copy

import pytest
import torch
from support.tiny_models import exact_mode_matches_greedy, make_pair

from fly_llm.common.config import ModelSpec
from fly_llm.decoding.cache import BatchKV
from fly_llm.model import fused_layers, quantization
from fly_llm.model.w4a8_layers import FusedW4A8
from fly_llm.model.kernels import layer_ops, w4a8
from fly_llm.model.pair import load_models
from fly_llm.model.quantization import quantize

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not w4a8.available(), reason="the w4a8 kernel cannot be built or run here")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        kv = BatchKV.prefill(model, ids[:-3].tolist(), CPU)
        return kv.forward(model, ids[None, -3:], logits_to_keep=3)


def _lean_layers(model: torch.nn.Module) -> int:
    """How many decoder layers of `model` run the fused layer forward."""
    return sum(isinstance(m, fused_layers.FusedDecoderLayer) for m in model.modules())


@pytest.mark.parametrize("ops", ["native", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_model_gives_the_unfused_models_logits(arch, dtype, ops, monkeypatch):
    target, _, tokenizer = make_pair(arch, dtype=dtype, device="cpu")
    unfused = copy.deepcopy(target)
    with monkeypatch.context() as patch:
        patch.setattr(quantization, "fuse", lambda model: 0)
        quantize(unfused, "w4a8", CPU)
    quantize(target, "w4a8", CPU)
    fused = [m for m in target.modules() if isinstance(m, FusedW4A8)]
    assert len(fused) == 2 * target.config.num_hidden_layers  # q/k/v and gate/up of every layer
    assert _lean_layers(target) == target.config.num_hidden_layers and _lean_layers(unfused) == 0
    assert not any(isinstance(m, FusedW4A8) for m in unfused.modules())
    patched = [m for m in target.modules() if "forward" in vars(m)]
    assert patched == [target.model]  # layers converted; only the model's lean forward is the instance's
    kinds = {type(m).__name__ for m in target.modules()}
    assert {"FusedAttention", "FusedMLP", f"Fused{arch.capitalize()}DecoderLayer"} <= kinds
    if ops == "torch":
        monkeypatch.setattr(layer_ops, "native", lambda *tensors: False)
    else:
        assert layer_ops.available()
    ids = torch.tensor(tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n"))
    out, expected = _logits(target, ids), _logits(unfused, ids)
    if ops == "torch":
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-3 if dtype == torch.float32 else 0.25)


def test_exact_mode_reproduces_a_fused_bf16_target(tiny_pair_dirs):
    """FLy off on a bf16 W4A8 pair running the fused layers: the target's own greedy output."""
    loaded = load_models(ModelSpec(target=str(tiny_pair_dirs[0]), draft=str(tiny_pair_dirs[1]), dtype="bfloat16",
                                   device="cpu", target_quantization="w4a8", draft_quantization="w4a8"),
                         progress=False)
    assert _lean_layers(loaded.target) == loaded.target.config.num_hidden_layers
    exact_mode_matches_greedy(loaded, ["def add(a, b):", "the quick brown fox " * 6], 20)


def test_other_schemes_are_not_fused():
    target, _, _ = make_pair("qwen2", device="cpu")
    if quantization.int8_available():
        quantize(target, "int8", CPU)
    assert not any(isinstance(m, FusedW4A8) for m in target.modules())


def _fused_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    target, _, tokenizer = make_pair("llama", device="cpu")
    quantize(target, "w4a8", CPU)
    return target, torch.tensor(tokenizer.encode("def fibonacci(n):\n    if n < 2:\n"))


def test_every_forward_looks_the_kernel_path_up(monkeypatch):
    """$FLY_W4A8_ISA is read by each layer forward (not once at import): a changed variable is seen."""
    target, ids = _fused_llama()
    expected = _logits(target, ids)
    monkeypatch.setenv(w4a8.ISA_ENV, "avx2")
    assert torch.equal(_logits(target, ids), expected)  # the paths agree bit for bit
    monkeypatch.setenv(w4a8.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="unknown w4a8 instruction set"):
        _logits(target, ids)


class _Counted(torch.nn.Module):
    """Another module's forward, counting its calls (a projection that is not a W4A8 layer)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


def test_a_fused_layer_calls_an_o_proj_or_down_proj_that_is_not_w4a8_as_a_module():
    target, ids = _fused_llama()
    expected = _logits(target, ids)
    layer = target.model.layers[0]
    layer.self_attn.o_proj, layer.mlp.down_proj = _Counted(layer.self_attn.o_proj), _Counted(layer.mlp.down_proj)
    assert torch.equal(_logits(target, ids), expected)
    assert layer.self_attn.o_proj.calls == layer.mlp.down_proj.calls == 2  # the prefill and the 3-token forward


@pytest.mark.parametrize("ops", ["native", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_lean_model_forward_gives_the_stock_forwards_logits(arch, ops, monkeypatch):
    """A ragged two-row batch with holes, decode steps and a 3-token forward: the lean forward
    (`_model_forward`) against transformers' own model forward over the same fused layers, bit for bit."""
    target, _, tokenizer = make_pair(arch, dtype=torch.bfloat16, device="cpu")
    quantize(target, "w4a8", CPU)
    assert target.model.forward.__func__ is fused_layers._model_forward
    if ops == "torch":
        monkeypatch.setattr(layer_ops, "native", lambda *tensors: False)
    ids = tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")

    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            kv = BatchKV.prefill(target, ids[:9], CPU)
            kv.add_row(BatchKV.prefill(target, ids[:5], CPU))
            out = [kv.forward(target, torch.tensor([ids[9:12], ids[5:8]]), logits_to_keep=3)]
            kv.truncate([10, 8])  # the first row keeps one of its three: two holes
            for token in ids[12:15]:
                out.append(kv.forward(target, torch.tensor([[token], [token]]), logits_to_keep=1))
            return out

    lean = run()
    del target.model.forward  # transformers' forward (its decorators, mask functions, module calls)
    for got, expected in zip(lean, run(), strict=True):
        assert torch.equal(got, expected)


def test_other_calls_and_partly_fused_models_take_transformers_forward():
    target, ids = _fused_llama()
    with torch.inference_mode():
        out = target(input_ids=ids[None], output_hidden_states=True)  # no cache, hidden states asked for
    assert len(out.hidden_states) == target.config.num_hidden_layers + 1
    layer = target.model.layers[1]
    layer.__class__ = type(layer).__bases__[1]  # transformers' layer (over fused modules): not a lean model
    assert not fused_layers._lean_model(target.model)
