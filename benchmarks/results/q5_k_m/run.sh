#!/bin/bash
# A Q5_K_M target side by side (issue 44: Q5_K read as published): target-only, FLy (the embedded draft) and
# llama.cpp on the same Q5_K_M file. The file is the embedded target's Q4_K_M requantized by llama.cpp's own
# llama-quantize (no network beyond the package registry: the tool builds from llama-cpp-python's sdist).
# Usage: bash run.sh OUT_DIR   (from the repository root, under the shared CPU lock)
set -eu
OUT=${1:?output directory}
WORK=/work/q5km
mkdir -p "$OUT" "$WORK"
bash benchmarks/serving/build_llama_server.sh /work/llama-server
cmake --build /work/llama-server/build --target llama-quantize -j2
python -c "
from pathlib import Path
from fly_llm.model.embedded import TARGET, assemble_gguf
assemble_gguf(TARGET, Path('$WORK'), progress=False)"
T=$WORK/Qwen2.5-Coder-1.5B-Instruct-Q5_K_M.gguf
[ -f "$T" ] || /work/llama-server/build/bin/llama-quantize --allow-requantize \
  "$WORK/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf" "$T" Q5_K_M 1 > "$OUT/quantize.log" 2>&1
D=$(python -c "from fly_llm.model.embedded import ensure_default_pair; print(ensure_default_pair(progress=False)[1])")
for part in "humaneval 16 256" "gsm8k 16 256"; do
  set -- $part
  [ -f "$OUT/$1/results.json" ] && continue
  date -u +%FT%TZ > "$OUT/$1.start"
  python -m benchmarks.harness.cli --dataset $1 --limit $2 --max-tokens $3 --target "$T" --draft "$D" \
    --methods target fly llamacpp llamacpp-flash-attn --threads 2 --out "$OUT/$1" > "$OUT/$1.log" 2>&1; echo rc=$? >> "$OUT/$1.log"
  date -u +%FT%TZ > "$OUT/$1.end"
done
