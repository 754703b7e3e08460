#!/bin/bash
# fly-bench speed side by side: target-only, FLy at the paper's defaults (fly, in this snapshot) and W=1 θ=0.5.
set -u
SRC=${SRC:-/work/wt1}   # a worktree of 3c722df with the fly-w1-gate methods (42c04b1 has them)
OUT=${OUT:-/work/runs/s13/speed}
mkdir -p "$OUT"
export PYTHONPATH=$SRC:$SRC/daemon:$SRC/integrations
cd "$SRC"
part() {  # name, fly-bench args...
  local name=$1; shift
  [ -f "$OUT/$name/results.json" ] && { echo "$name: done already"; return; }
  flock /tmp/fly-cpu.lock sh -c "date -u +%FT%TZ > $OUT/$name.start; ps -eo pcpu,args --sort=-pcpu | head -5 > $OUT/$name.load-before; \
    python -m benchmarks.harness.cli $* --methods target fly fly-w1-gate0.5 --threads 2 --out $OUT/$name > $OUT/$name.log 2>&1; echo rc=\$? >> $OUT/$name.log; \
    ps -eo pcpu,args --sort=-pcpu | head -5 > $OUT/$name.load-after; date -u +%FT%TZ > $OUT/$name.end"
  echo "$name: $(tail -1 $OUT/$name.log)"
}
part prose --dataset prose --limit 10 --max-tokens 128
part humaneval --dataset humaneval --limit 16 --max-tokens 256
part gsm8k --dataset gsm8k --limit 16 --max-tokens 256
part rag --dataset rag --limit 8 --max-tokens 256
