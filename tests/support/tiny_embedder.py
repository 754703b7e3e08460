"""A tiny random-weight BERT sentence encoder saved like a sentence-transformers model, and its reference output.

`save_tiny_embedder(dir)` writes a BertModel (2 layers, 32 dimensions) with a WordPiece tokenizer
(lowercase letters and their '##' pieces, a few whole words) and sentence-transformers' config files
(max_seq_length, mean pooling): what `fly-daemon start --embedding-model DIR` loads in tests. `reference`
computes the model's own sentence vectors directly with transformers (what sentence-transformers does), so
the daemon's answers are checked against numbers it did not compute.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, BertTokenizer

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "lisp", "startup", "essay", "retrieval"]
MAX_SEQ_LENGTH = 24
"""Tokens (special ones included) the tiny encoder reads: short, so tests reach truncation easily."""
DIMENSIONS = 32


def save_tiny_embedder(directory: Path, max_seq_length: int = MAX_SEQ_LENGTH) -> Path:
    """Write the tiny encoder to `directory` (created); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    letters = list(string.ascii_lowercase + string.digits)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters), *WORDS, ".", ","]
    tokenizer = BertTokenizer(vocab={word: i for i, word in enumerate(vocab)})
    tokenizer.save_pretrained(directory)
    config = BertConfig(vocab_size=len(vocab), hidden_size=DIMENSIONS, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(directory)
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": DIMENSIONS, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    return directory


def reference(directory: Path | str, texts: list[str], max_length: int = MAX_SEQ_LENGTH) -> torch.Tensor:
    """The model's own unit sentence vectors of `texts` (truncated to `max_length`): tokenizer, encoder, mean
    pooling over the attention mask, L2 norm, with plain transformers."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
