"""The kernel-variants bench with Q6_K packed as nibbles and planes (the layout before whole bytes)."""
import sys
from fly_llm.model.kernels import w4a8
w4a8.whole_bytes = lambda bits: bits == 4
sys.argv = ["kernel_variants_bench.py", *sys.argv[1:]]
from benchmarks.forward import kernel_variants_bench
kernel_variants_bench.main()
