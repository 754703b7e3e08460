"""Tiny random-weight model pairs and a locally trained tokenizer, for tests (no downloads).

`save_tiny_pair(dir, arch)` writes `dir/target` and `dir/draft`: HF model directories sharing
one byte-level BPE tokenizer with a chat template. The draft is the target with its weights
perturbed, so the two agree often but not always — enough to exercise accepts and rejects.
`write_tiny_gguf(path, model, tokenizer)` writes a tiny Llama as a float32 GGUF file.
`exact_mode_matches_greedy(loaded, prompts, n)` checks the engine's exact mode against `greedy_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.decoding.engine import FLyEngine
from support.device import TEST_DEVICE

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Retrieval augmented generation answers questions from documents.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "for i in range(10):\n    print(i * i)\n",
    "Question: what is 2 + 3? Answer: 5. Question: what is 7 * 6? Answer: 42.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n",
]
CHAT_TEMPLATE = (  # ChatML; tool names (short: the tiny models' context is 512) and calls in the Hermes / Qwen2.5 style
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FIM_SPECIAL = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"]
"""Qwen2.5-Coder's fill-in-the-middle and repository tokens, added by `make_tokenizer(fim=True)`."""


def make_tokenizer(vocab_size: int = 320, fim: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on CORPUS, with EOS and a ChatML template; with `fim`, also
    FIM_SPECIAL as special tokens (ids after the trained vocabulary)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    if fim:
        fast.add_special_tokens({"additional_special_tokens": FIM_SPECIAL})
    return fast


def make_config(arch: str, vocab_size: int, dtype: torch.dtype = torch.float32, **size: int):
    """A 2-layer config of the given architecture ('llama' or 'qwen2'); `size` overrides its dimensions."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None) | size
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    cfg = cls(**common)
    cfg.dtype = dtype
    return cfg


def make_pair(arch: str = "llama", seed: int = 0, noise: float = 0.1, dtype: torch.dtype = torch.float32,
              device: str = TEST_DEVICE, fim: bool = False, **size: int):
    """Return (target, draft, tokenizer) on `device`: random target, draft = target with multiplicative noise;
    with `fim`, the tokenizer has FIM tokens (FIM_SPECIAL)."""
    tokenizer = make_tokenizer(fim=fim)
    config = make_config(arch, len(tokenizer), dtype, **size)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        # Sharper output distributions than the default init, so greedy choices are rarely near-ties.
        target.lm_head.weight.mul_(24.0)
    draft = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(1 + noise * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return target.to(device), draft.to(device), tokenizer


def save_tiny_pair(root: Path, arch: str = "llama", seed: int = 0, **size: int) -> tuple[Path, Path]:
    """Write target and draft model dirs (each with the tokenizer) under root; return their paths."""
    target, draft, tokenizer = make_pair(arch, seed, device="cpu", **size)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = Path(root) / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def _permute_for_gguf(w: torch.Tensor, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py LlamaModel.permute); transformers undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).numpy()


def write_tiny_gguf(path: Path, model, tokenizer, raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]
                    | None = None) -> Path:
    """Write a tiny Llama with its byte-level BPE tokenizer as a float32 GGUF file transformers reads.

    `raw` maps GGUF tensor names to quantized blocks (in GGUF's own row order) written instead of those weights."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = tensor.detach().float().cpu()
        if ".attn_q." in name:
            array = _permute_for_gguf(data, cfg.num_attention_heads)
        elif ".attn_k." in name:
            array = _permute_for_gguf(data, cfg.num_key_value_heads)
        else:
            array = data.numpy()
        if name in (raw or {}):
            writer.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def greedy_tokens(target, prompt_ids: list[int], max_new: int, eos_ids: list[int] | None = None,
                  **generate_kwargs) -> list[int]:
    """The target's own greedy continuation of `prompt_ids` (HF `generate`), cut after the first of `eos_ids`."""
    out = target.generate(torch.tensor([prompt_ids], device=target.device),
                          attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=target.device),
                          max_new_tokens=max_new, do_sample=False, **generate_kwargs)
    tokens = out[0, len(prompt_ids):].tolist()
    ends = [i for i, t in enumerate(tokens) if t in (eos_ids or ())]
    return tokens[:ends[0] + 1] if ends else tokens


def exact_mode_matches_greedy(loaded, prompts: list[str], max_tokens: int) -> None:
    """Decode `prompts` together in exact mode with the draft model forced every round (loose off,
    adaptive off) and assert each output is the loaded target's own greedy continuation."""
    engine = FLyEngine(loaded.target, loaded.tokenizer, loaded.draft, FLyConfig(loose=False, adaptive=False))
    ids = [loaded.tokenizer.encode(text) for text in prompts]
    for i, prompt in enumerate(ids):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(ids))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert engine.stats.draft_model_rounds > 0
    for i, prompt in enumerate(ids):
        assert tokens[str(i)] == greedy_tokens(loaded.target, prompt, max_tokens, [loaded.tokenizer.eos_token_id])
