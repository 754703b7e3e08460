"""Measuring fly-llm (docs/benchmarks.md). `harness` is fly-bench and the code the scripts share; the scripts are
grouped by what they time: `forward` (one model forward: kernels, weights, activations), `engine` (decoding in one
process), `serving` (the daemon and its doors). A script imports the harness and scripts of its own group only."""
