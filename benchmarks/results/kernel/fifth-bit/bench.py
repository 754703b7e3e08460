"""Q4_K (two-level) one-row and four-row matmuls: the kernel before the fifth-bit change (966daf8) and after, alternating."""
import statistics, time, sys
from pathlib import Path
import torch
from fly_llm.model.kernels import w4a8
from fly_llm.model.kernels.build import compile_extension
torch.set_num_threads(2)
old = compile_extension("fly_w4a8_old", Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kold/w4a8_old.cpp"), Path("/tmp/kold/build"))
new = w4a8._native()
g = torch.Generator().manual_seed(0)
def two_level(n, k, bits=0):
    return w4a8.SuperBlockWeight(torch.randint(0, 16 << bits, (n, k), dtype=torch.uint8, generator=g),
        (torch.rand(n, k // 256, generator=g) * 2**-6).half(), (torch.rand(n, k // 256, generator=g) * 2**-6).half(),
        torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g), torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g), bits)
shapes = [(17920, 1536), (1536, 8960), (2048, 1536)] * 4  # ~ gate_up, down, qkv of the 1.5B target, several copies (stream from memory)
packed = [w4a8.pack(two_level(n, k)) for n, k in shapes]
five = [w4a8.pack(two_level(n, k, 1)) for n, k in shapes]
def run(ops, weights, rows, with_planes):
    xs = [torch.randn(rows, w.q.shape[1] * 32).bfloat16() for w in weights]
    t = time.perf_counter()
    for x, w in zip(xs, weights):
        L = w.levels
        if with_planes:
            ops.linear(x, w.q, w.planes, None, None, L.d, L.m, L.sc, L.mn, None, w.n, 2)
        else:
            ops.linear(x, w.q, None, None, L.d, L.m, L.sc, L.mn, None, w.n, 2)
    return (time.perf_counter() - t) * 1000
for rows in (1, 4):
    times = {"before (966daf8)": [], "after, Q4_K": [], "after, Q5_K": []}
    for _ in range(15):
        times["before (966daf8)"].append(run(old, packed, rows, False))
        times["after, Q4_K"].append(run(new, packed, rows, True))
        times["after, Q5_K"].append(run(new, five, rows, True))
    base = statistics.median(times["before (966daf8)"])
    print(f"rows {rows}: " + ", ".join(f"{k} {statistics.median(v):.2f} ms ({statistics.median(v)/base:.3f}x)" for k, v in times.items()))
