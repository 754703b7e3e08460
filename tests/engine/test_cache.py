"""BatchKV: ragged rows with holes, joins and leaves give each row exactly its alone logits."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from fly_llm.decoding.cache import BatchKV
from support.tiny_models import make_pair

torch.set_num_threads(1)  # tiny models: threads only contend on a shared CPU


def _alone_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of the last position for `tokens`, computed with no batching at all."""
    out = model(torch.tensor([tokens], device=model.device), cache=DynamicCache(config=model.config),
                use_cache=True)
    return out.logits[0, -1]


def _prefill(model, tokens: list[int]) -> BatchKV:
    return BatchKV.prefill(model, tokens, model.device)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ragged_rounds_match_alone_float64(arch):
    model = make_pair(arch, dtype=torch.float64)[0]
    rng = random.Random(0)
    vocab = model.config.vocab_size
    kv = BatchKV(model.device)
    rows: list[list[int]] = []

    def join(n: int) -> None:
        tokens = [rng.randrange(vocab) for _ in range(n)]
        kv.add_row(_prefill(model, tokens))
        rows.append(tokens)

    for n in (5, 1, 12):
        join(n)
    with torch.inference_mode():
        for round_ in range(14):
            if round_ == 4:
                join(3)
            if round_ == 7:
                join(20)
            if round_ == 9:
                kv.remove_rows([0, 2, 3, 4])
                del rows[1]
            q = rng.randint(1, 6)
            new = [[rng.randrange(vocab) for _ in range(q)] for _ in rows]
            mask, pos = kv.inputs(q)
            logits = model(torch.tensor(new, device=model.device), cache=kv.cache, attention_mask=mask,
                           position_ids=pos, use_cache=True).logits
            kv.advance(q)
            keep = [rng.randint(1, q) for _ in rows]
            for b, tokens in enumerate(rows):
                expected = _alone_logits(model, tokens + new[b][:keep[b]])
                torch.testing.assert_close(logits[b, keep[b] - 1], expected, rtol=1e-9, atol=1e-9)
                tokens.extend(new[b][:keep[b]])
            kv.truncate([len(t) for t in rows])
            assert kv.lengths == [len(t) for t in rows]
            assert kv.width >= max(kv.lengths)
        kv.compact()
        assert kv.width == max(len(t) for t in rows)
        mask, pos = kv.inputs(1)
        new = [[rng.randrange(vocab)] for _ in rows]
        logits = model(torch.tensor(new, device=model.device), cache=kv.cache, attention_mask=mask,
                       position_ids=pos, use_cache=True).logits
        for b, tokens in enumerate(rows):
            torch.testing.assert_close(logits[b, 0], _alone_logits(model, tokens + new[b]), rtol=1e-9, atol=1e-9)


def test_buffers_are_not_reallocated_each_round():
    model = make_pair("llama")[0]
    kv = _prefill(model, [1, 2, 3])
    layer = kv.cache.layers[0]
    buffer = layer._k.data_ptr()
    with torch.inference_mode():
        for _ in range(5):
            mask, pos = kv.inputs(4)
            model(torch.tensor([[4, 5, 6, 7]], device=model.device), cache=kv.cache, attention_mask=mask,
                  position_ids=pos, use_cache=True)
            kv.advance(4)
            kv.truncate([kv.lengths[0] - 2])
    assert layer._k.data_ptr() == buffer
    assert kv.width == kv.lengths[0] == 3 + 5 * 2


def test_row_kv_skips_holes_and_single_row_seeds_a_row_that_extends_like_a_prefill():
    """float64: a row's kept KV read out of a batch with holes equals its KV computed alone, and a
    one-row cache seeded with part of it (in pieces) and extended equals a prefill of the whole."""
    model = make_pair("llama", dtype=torch.float64)[0]
    rng = random.Random(1)
    rows = [[rng.randrange(5, 300) for _ in range(n)] for n in (9, 4)]
    kv = BatchKV(model.device)
    for tokens in rows:
        kv.add_row(_prefill(model, tokens))
    with torch.inference_mode():
        for _ in range(3):  # append 3 columns per row, keep 1 or 2: holes
            new = [[rng.randrange(5, 300) for _ in range(3)] for _ in rows]
            kv.forward(model, torch.tensor(new, device=model.device))
            for tokens, more, keep in zip(rows, new, (1, 2)):
                tokens.extend(more[:keep])
            kv.truncate([len(t) for t in rows])
        assert kv.width > max(kv.lengths)  # there are holes
        for b, tokens in enumerate(rows):
            alone = _prefill(model, tokens)
            for (k, v), layer in zip(kv.row_kv(b, 0, len(tokens)), alone.cache.layers):
                torch.testing.assert_close(k, layer.keys[0], rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(v, layer.values[0], rtol=1e-9, atol=1e-9)
        tokens = rows[0]
        parts = [([k[:, :3], k[:, 3:5]], [v[:, :3], v[:, 3:5]]) for k, v in kv.row_kv(0, 0, 5)]
        seeded = BatchKV.single_row(parts, model.device)
        seeded.extend(model, tokens[5:])
        seeded.check()
        for mine, theirs in zip(seeded.cache.layers, _prefill(model, tokens).cache.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-9, atol=1e-9)
