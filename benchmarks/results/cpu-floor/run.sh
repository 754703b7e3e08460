#!/bin/bash
# The cpu-floor side-by-side: one fly-bench invocation per dataset, each under the shared CPU lock.
set -u
COMMIT=${1:?commit}
SRC=/tmp/cpufloor-run
OUT=/tmp/cpufloor-out
rm -rf "$SRC"; git clone -q /work/main "$SRC" && git -C "$SRC" checkout -q "$COMMIT" || exit 1
mkdir -p "$OUT"
export PYTHONPATH=$SRC:$SRC/daemon:$SRC/integrations
cd "$SRC"
part() {  # name, fly-bench args...
  local name=$1; shift
  [ -f "$OUT/$name/results.json" ] && { echo "$name: done already"; return; }
  flock /tmp/cpu-heavy.lock sh -c "date -u +%FT%TZ > $OUT/$name.start; ps -eo pcpu,args --sort=-pcpu | head -5 > $OUT/$name.load-before; \
    python -m benchmarks.harness.cli $* --methods fly llamacpp llamacpp-flash-attn --threads 2 --out $OUT/$name > $OUT/$name.log 2>&1; echo rc=\$? >> $OUT/$name.log; \
    ps -eo pcpu,args --sort=-pcpu | head -5 > $OUT/$name.load-after; date -u +%FT%TZ > $OUT/$name.end"
  echo "$name: $(tail -1 $OUT/$name.log)"
}
part humaneval --dataset humaneval --limit 16 --max-tokens 256
part gsm8k --dataset gsm8k --limit 16 --max-tokens 256
part rag --dataset rag --limit 8 --max-tokens 256
part prose --dataset prose --limit 10 --max-tokens 128
