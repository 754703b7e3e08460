"""32 concurrent clients (threads, then asyncio tasks) each get their own correct answer, batched."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from fly_llm.client import AsyncFLyClient, FLyClient, build_options

N = 32
PROMPTS = [f"{word} {i}" for i, word in enumerate(
    ["def add", "The quick", "for i in", "class Stack", "Question: what is", "Retrieval", "print(", "return"] * 4)]
SAMPLING, FLY = build_options(max_tokens=24, loose=False)


@pytest.fixture(scope="module")
def expected(tiny_daemon):
    """Each prompt run alone, one after another."""
    with FLyClient(tiny_daemon, timeout=120) as client:
        return [client.generate(p, SAMPLING, FLY).token_ids for p in PROMPTS]


def test_threads_each_get_their_answer(tiny_daemon, expected):
    with FLyClient(tiny_daemon, timeout=120) as client:  # one client shared by all threads
        with ThreadPoolExecutor(N) as pool:
            got = list(pool.map(lambda p: client.generate(p, SAMPLING, FLY).token_ids, PROMPTS))
        assert got == expected
        assert client.status().max_batch_size_seen > 1


def test_threads_with_their_own_clients_streaming(tiny_daemon, expected):
    def one(i: int) -> list[int]:
        with FLyClient(tiny_daemon, timeout=120) as client:
            return list(client.stream(PROMPTS[i], sampling=SAMPLING, fly=FLY))[-1].token_ids

    with ThreadPoolExecutor(N) as pool:
        assert list(pool.map(one, range(N))) == expected


async def test_asyncio_tasks_each_get_their_answer(tiny_daemon, expected):
    async with AsyncFLyClient(tiny_daemon, timeout=120) as client:
        async def streamed(prompt: str) -> list[int]:
            return [c async for c in client.stream(prompt, sampling=SAMPLING, fly=FLY)][-1].token_ids

        plain = asyncio.gather(*(client.generate(p, SAMPLING, FLY) for p in PROMPTS[: N // 2]))
        streams = asyncio.gather(*(streamed(p) for p in PROMPTS[N // 2:]))
        got = [r.token_ids for r in await plain] + await streams
        assert got == expected
        status = await client.status()
        assert status.max_batch_size_seen > 1 and status.active == 0
