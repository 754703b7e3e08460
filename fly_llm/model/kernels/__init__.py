"""Native CPU kernels, compiled once on first use (fly_llm.model.kernels.build).

- `w4a8`: a Linear with 4-bit weights and int8 activations on integer dot products
  (AVX-512 VNNI or AVX2), batch-invariant bit for bit (docs/models.md).
"""
