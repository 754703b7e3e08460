"""The names and sizes the fronts give the served model (issue 64): ids are never paths, Ollama's clients may
name it as the Ollama library does (`qwen2.5-coder:1.5b`), and a 4-bit model's parameter count is its weights'."""

from __future__ import annotations

import copy

import torch

from fly_daemon.http.ollama_api import ollama_alias, same_model
from fly_daemon.model_info import _weights, served_id
from fly_llm.model.quantization import quantize
from support.tiny_models import make_pair

EMBEDDED = "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"


def test_an_id_is_a_paths_last_part_without_the_caches_key_or_gguf():
    assert served_id(f"/root/.cache/fly-llm/{EMBEDDED}-cc324af070c2") == EMBEDDED
    assert served_id("/models/mistral-7b.Q4_K_M.gguf") == "mistral-7b.Q4_K_M"
    assert served_id("Qwen/Qwen2.5-0.5B") == "Qwen2.5-0.5B"
    assert served_id("counting") == "counting"  # a name already
    assert served_id("/data/run-0123456789ab-final") == "run-0123456789ab-final"  # a key only at the end


def test_ollama_clients_may_name_the_model_as_the_library_does():
    assert ollama_alias(EMBEDDED) == "qwen2.5-coder:1.5b" and ollama_alias("Llama-3.2-3B-Instruct") == "llama-3.2:3b"
    assert ollama_alias("tiny-target") is None
    for asked in (EMBEDDED, f"{EMBEDDED}:latest", "qwen2.5-coder:1.5b", "Qwen2.5-Coder:1.5B"):
        assert same_model(asked, EMBEDDED), asked
    for asked in ("qwen2.5-coder:7b", "llama3", "qwen2.5-coder", ""):
        assert not same_model(asked, EMBEDDED), asked


def test_a_4_bit_models_parameter_count_is_its_weights():
    target, _, _ = make_pair("llama", device="cpu")
    plain = sum(p.numel() for p in target.parameters())
    packed = copy.deepcopy(target)
    quantize(packed, "w4a8", torch.device("cpu"))
    assert sum(p.numel() for p in packed.parameters()) < plain  # the packed weights are buffers
    assert _weights(packed) == _weights(target) == plain
