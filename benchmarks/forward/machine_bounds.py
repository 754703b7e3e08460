"""How close the W4A8 matmuls of one forward are to what this machine allows (issue 34, "if an aim is out of
reach, say which part of the step holds it back"):

    python benchmarks/forward/machine_bounds.py --threads 2 --out benchmarks/results/kernel/bounds

Two probes, compiled inline for this benchmark only: the memory read bandwidth (AVX-512 or AVX2 loads over
1 GiB, torch's threads) and the VNNI throughput (independent `vpdpbusd` on 512-bit registers, per thread,
then all threads at once). Then the embedded target's and draft's Linear layers (w4a8, in model order over
distinct weights, as kernel_bench times them) at M = 1 and 16 rows, each beside its bound: at M = 1 the bytes
of packed weights a forward streams over the read bandwidth; at M = 16 the `vpdpbusd` it needs (one per 64
weight x activation products per row) over the VNNI throughput. The machine is shared (a VM whose memory
bandwidth and second core vary by ±30% within minutes), so every figure is the best of --rounds rounds that
take turns.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from benchmarks.forward.kernel_bench import _LINEAR_TYPES, linears_ms
from benchmarks.harness.environment import cpu_name
from fly_llm.common.config import ModelSpec
from fly_llm.model.embedded import ensure_default_pair
from fly_llm.model.pair import load_models

_PROBES = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>

__attribute__((target("avx2"))) static int64_t read_range(const uint8_t* p, int64_t begin, int64_t end) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (int64_t i = begin; i < end; i += 128) {
    a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i*)(p + i)));
    b = _mm256_xor_si256(b, _mm256_loadu_si256((const __m256i*)(p + i + 32)));
    c = _mm256_xor_si256(c, _mm256_loadu_si256((const __m256i*)(p + i + 64)));
    d = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i*)(p + i + 96)));
  }
  a = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
  return _mm256_extract_epi64(a, 0);
}

// Seconds to read every byte of `buffer` once (its length a multiple of 128), split over torch's threads.
double read_seconds(const torch::Tensor& buffer) {
  const uint8_t* p = buffer.data_ptr<uint8_t>();
  const int64_t lines = buffer.numel() / 128;
  std::atomic<int64_t> sink{0};
  auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, lines, 1024, [&](int64_t b, int64_t e) { sink ^= read_range(p, b * 128, e * 128); });
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  return took.count() + (sink == 42 ? 1e-12 : 0.0);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static int32_t vnni_loop(int64_t iterations) {
  __m512i acc[12];
  const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  for (int64_t n = 0; n < iterations; ++n)
    for (int i = 0; i < 12; ++i) {
      acc[i] = _mm512_dpbusd_epi32(acc[i], u, s);
      __asm__ volatile("" : "+v"(acc[i]));
    }
  int32_t total = 0;
  for (int i = 0; i < 12; ++i) total += _mm_cvtsi128_si32(_mm512_castsi512_si128(acc[i]));
  return total;
}

// Seconds for `threads` threads to run 12 * iterations independent vpdpbusd each (zmm).
double vnni_seconds(int64_t iterations, int64_t threads) {
  std::atomic<int32_t> sink{0};
  auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) sink += vnni_loop(iterations);
  });
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  return took.count() + (sink == 42 ? 1e-12 : 0.0);
}
"""


def probes():
    """The compiled probes (read_seconds, vnni_seconds)."""
    return cpp_extension.load_inline("fly_machine_probes", cpp_sources=_PROBES,
                                     functions=["read_seconds", "vnni_seconds"],
                                     extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])


def read_bandwidth(ops, reps: int) -> float:
    """Bytes per second read over 1 GiB with torch's threads (best of `reps`)."""
    buffer = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8)
    return buffer.numel() / min(ops.read_seconds(buffer) for _ in range(reps))


def vnni_rate(ops, threads: int, reps: int, iterations: int = 20_000_000) -> float:
    """vpdpbusd (zmm) per second, all `threads` together (best of `reps`)."""
    return 12 * iterations * threads / min(ops.vnni_seconds(iterations, threads) for _ in range(reps))


def matmul_demand(model: torch.nn.Module) -> tuple[int, int]:
    """(packed weight bytes, vpdpbusd per input row) of one pass over `model`'s w4a8 Linear layers."""
    packed = [m.packed for m in model.modules() if isinstance(m, _LINEAR_TYPES) and hasattr(m, "packed")]
    size = sum(p.streamed_bytes() for p in packed)
    return size, sum(p.weight_count() // 64 for p in packed)  # 64 products per vpdpbusd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every probe and timing; the best is kept")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = probes()
    target, draft = ensure_default_pair(progress=False)
    loaded = load_models(ModelSpec(target=str(target), draft=str(draft), dtype="auto"), progress=False)
    models = {"target": loaded.target, "draft": loaded.draft}
    best: dict[str, float] = {}

    def keep(name: str, value: float, low: bool) -> None:
        best[name] = min(best.get(name, value), value) if low else max(best.get(name, value), value)

    for _ in range(args.rounds):  # the machine is shared: each figure is the best of its rounds, probes between
        keep("bandwidth", read_bandwidth(ops, args.reps), low=False)
        keep("vnni_one", vnni_rate(ops, 1, args.reps), low=False)
        keep("vnni_all", vnni_rate(ops, args.threads, args.reps), low=False)
        for role, model in models.items():
            keep(f"{role} 1", linears_ms(model, 1, args.reps), low=True)
            keep(f"{role} 16", linears_ms(model, 16, args.reps), low=True)
    rows = []
    for role, model in models.items():
        size, per_row = matmul_demand(model)
        rows.append({"model": role, "weight_bytes": size, "m1_ms": round(best[f"{role} 1"], 2),
                     "m1_bound_ms": round(size / best["bandwidth"] * 1000, 2), "m16_ms": round(best[f"{role} 16"], 2),
                     "m16_bound_ms": round(16 * per_row / best["vnni_all"] * 1000, 2)})
    bandwidth, vnni_one, vnni_all = best["bandwidth"], best["vnni_one"], best["vnni_all"]
    result = {"cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__, "when": time.strftime("%F %T"),
              "read_gb_s": round(bandwidth / 1e9, 1), "vnni_per_s_one_thread": round(vnni_one / 1e9, 2),
              "vnni_per_s_all": round(vnni_all / 1e9, 2), "models": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# W4A8 matmuls against this machine's bounds ({result['cpu']}, {args.threads} threads, "
             f"torch {torch.__version__})", "",
             f"Read bandwidth {result['read_gb_s']} GB/s; vpdpbusd (zmm) {result['vnni_per_s_one_thread']} G/s on one "
             f"thread, {result['vnni_per_s_all']} G/s on {args.threads}.", "",
             "| model | packed weights MB | M=1 ms | bound (bytes / bandwidth) | M=16 ms | bound (vpdpbusd / rate) |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['weight_bytes'] / 1e6:.0f} | {r['m1_ms']} | {r['m1_bound_ms']} | {r['m16_ms']} | "
              f"{r['m16_bound_ms']} |" for r in rows]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
