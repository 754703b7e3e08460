"""End to end through a daemon subprocess on the tiny pair: every message kind, sync and async."""

from __future__ import annotations

import pytest

from support.device import TEST_DEVICE
from fly_llm.client import AsyncFLyClient, FLyClient, build_options
from fly_llm.common.errors import BadRequest, TooLong
from fly_llm.common.protocol import GenerateResult, TokenChunk

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "Question: what is 2 + 3?"]
EXACT = dict(max_tokens=24, loose=False)


@pytest.fixture(scope="module")
def client(tiny_daemon):
    with FLyClient(tiny_daemon, timeout=60) as c:
        yield c


def test_health_info_status(client, tiny_pair_dirs):
    assert client.health().state == "ready"
    info = client.info()
    assert info.target == tiny_pair_dirs[0].name and info.draft == tiny_pair_dirs[1].name  # ids, never paths
    assert info.dtype == "float32" and info.context_window == 512
    assert info.target_quantization == info.draft_quantization == "none"
    assert info.max_prompt_tokens == 511 and info.max_tokens_limit == 4096
    status = client.status()
    assert status.state == "ready" and status.pid > 0 and status.uptime_s > 0
    assert status.target == info.target


def test_generate_usage_and_stats(client):
    sampling, fly = build_options(max_tokens=16)
    result = client.generate(PROMPTS[0], sampling, fly)
    assert result.finish_reason in ("stop", "length")
    assert result.usage.completion_tokens == len(result.token_ids) > 0
    assert result.usage.prompt_tokens == client.tokenize(PROMPTS[0]).count
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert result.stats.rounds > 0 and result.stats.emitted == len(result.token_ids)
    assert result.time_to_first_token_s is not None and result.elapsed_s > 0


def test_stream_concatenates_to_generate(client):
    sampling, fly = build_options(**EXACT)
    for prompt in PROMPTS[:2]:
        items = list(client.stream(prompt, sampling=sampling, fly=fly))
        chunks, final = items[:-1], items[-1]
        assert isinstance(final, GenerateResult) and all(isinstance(c, TokenChunk) for c in chunks)
        assert "".join(c.text for c in chunks) == final.text
        assert [t for c in chunks for t in c.token_ids] == final.token_ids[:sum(len(c.token_ids) for c in chunks)]
        assert final.text == client.generate(prompt, sampling, fly).text


def test_exact_mode_matches_in_process_engine(client, tiny_pair_dirs):
    from fly_llm.common.config import FLyConfig, ModelSpec, SamplingParams
    from fly_llm.loading import load_engine

    spec = ModelSpec(target=str(tiny_pair_dirs[0]), draft=str(tiny_pair_dirs[1]), dtype="float32", device=TEST_DEVICE,
                     target_quantization="none")  # as the tiny daemon runs it
    engine = load_engine(spec, FLyConfig(loose=False))
    local = engine.generate(PROMPTS, SamplingParams(max_tokens=24))
    sampling, fly = build_options(**EXACT)
    remote = client.batch(PROMPTS, sampling, fly)
    assert [r.token_ids for r in remote] == [g.token_ids for g in local]
    assert [r.text for r in remote] == [g.text for g in local]


def test_batch_equals_one_by_one(client):
    sampling, fly = build_options(**EXACT)
    together = client.batch(PROMPTS, sampling, fly)
    alone = [client.generate(p, sampling, fly) for p in PROMPTS]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_chat_uses_the_chat_template(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    sampling, fly = build_options(**EXACT)
    result = client.chat(messages, sampling, fly)
    assert result.usage.prompt_tokens == client.tokenize(messages=messages).count
    assert client.tokenize(messages=messages).count > client.tokenize("What is 2 + 3?").count
    assert client.batch([messages], sampling, fly)[0].token_ids == result.token_ids
    streamed = list(client.stream(messages=messages, sampling=sampling, fly=fly))
    assert streamed[-1].token_ids == result.token_ids


def test_stop_strings_and_seeded_sampling(client):
    plain = client.generate(PROMPTS[1], *build_options(**EXACT))
    assert len(plain.text) > 3
    stop = plain.text[2:4]
    cut = client.generate(PROMPTS[1], *build_options(stop=[stop], **EXACT))
    assert stop not in cut.text and plain.text.startswith(cut.text) and cut.finish_reason == "stop"
    seeded = build_options(temperature=0.8, seed=7, max_tokens=16)
    assert client.generate(PROMPTS[2], *seeded).token_ids == client.generate(PROMPTS[2], *seeded).token_ids


def test_errors_are_raised_as_their_class(client):
    with pytest.raises(TooLong):
        client.generate("a " * 2000, *build_options(max_tokens=4))
    with pytest.raises(BadRequest):
        client.tokenize()


async def test_async_client_end_to_end(tiny_daemon):
    sampling, fly = build_options(**EXACT)
    async with AsyncFLyClient(tiny_daemon, timeout=60) as client:
        assert (await client.health()).state == "ready"
        assert (await client.info()).context_window == 512
        assert (await client.status()).state == "ready"
        result = await client.generate(PROMPTS[0], sampling, fly)
        chunks = [c async for c in client.stream(PROMPTS[0], sampling=sampling, fly=fly)]
        assert "".join(c.text for c in chunks[:-1]) == chunks[-1].text == result.text
        batch = await client.batch(PROMPTS, sampling, fly)
        assert batch[0].token_ids == result.token_ids
        chat = await client.chat([{"role": "user", "content": "hi"}], sampling, fly)
        assert chat.usage.prompt_tokens == (await client.tokenize(messages=[{"role": "user", "content": "hi"}])).count
    with FLyClient(tiny_daemon) as sync:
        assert [r.token_ids for r in sync.batch(PROMPTS, sampling, fly)] == [r.token_ids for r in batch]
