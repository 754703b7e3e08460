"""A bounded soak: 500 short requests; the daemon's memory must not keep growing."""

from __future__ import annotations

import psutil

from fly_llm.client import FLyClient, build_options

WARMUP, SOAK, BATCH = 100, 500, 50
RSS_GROWTH_BOUND = 40 * 2**20
"""Allowed growth of the daemon's resident memory over the 500 requests after warm-up (40 MiB)."""


def test_soak_memory_stays_bounded(tiny_daemon):
    sampling, fly = build_options(max_tokens=4)
    prompts = [f"def f{i}(x):" for i in range(BATCH)]
    with FLyClient(tiny_daemon, timeout=120) as client:
        daemon = psutil.Process(client.status().pid)
        for _ in range(WARMUP // BATCH):
            client.batch(prompts, sampling, fly)
        before = daemon.memory_info().rss
        served_before = client.status().requests_total
        for round_ in range(SOAK // BATCH):
            if round_ % 2:
                results = client.batch(prompts, sampling, fly)
            else:
                results = [client.generate(p, sampling, fly) for p in prompts[:10]]
                results += [list(client.stream(p, sampling=sampling, fly=fly))[-1] for p in prompts[10:]]
            assert all(r.usage.completion_tokens > 0 for r in results)
        growth = daemon.memory_info().rss - before
        status = client.status()
    print(f"daemon RSS {before / 2**20:.0f} MiB -> {(before + growth) / 2**20:.0f} MiB over {SOAK} requests")
    assert status.requests_total - served_before == SOAK
    assert status.active == 0 and status.queue_depth == 0
    assert growth < RSS_GROWTH_BOUND, f"daemon RSS grew by {growth / 2**20:.1f} MiB over {SOAK} requests"
