"""The model side (torch): load the target and draft, cache converted GGUFs, quantize their
layers, CPU attention and the native kernels."""
