#!/usr/bin/env bash
# Every GPU check of this repository in one command, for a lent GPU (one H100 or H200, 16 CPU
# cores), in about 8 minutes; results in bench/results/gpu.md (and gpu_*.md beside it).
#
#   bench/gpu/run.sh                  # on the GPU machine (its python3 holds a CUDA torch)
#   GPU_DRY_RUN=1 bench/gpu/run.sh    # every part on the CPU with tiny sizes: a rehearsal
#
# Without a CUDA device (and without GPU_DRY_RUN=1) it says so and exits 0: nothing to check,
# which is no failure (CI never has a GPU).
#
# Parts, each under its own timeout (one failing or running over never loses the others;
# GPU_BUDGET_S, default 480, bounds them all):
#   tests     the suite's CUDA tests: pytest -m gpu (every schedule, eager and compiled, on one GPU)
#   bench_1b  bench/gpu/bench_1b.py: 1B Llama bf16, plain Lightning vs ZeroPPStrategy, eager and
#             compiled: tokens/s, MFU
#   blocks    bench/gpu/block_times.py: one decoder layer's F, B, I, W times for the planner
#   zeropp    bench/bench_zeropp.py, one CPU core per rank, on cores 8-15 while the GPU parts run
#             on cores 0-7 (after them when the machine has fewer than 16 cores)
# With $OUT set (the device tool's output folder), the results are copied there too.
set -u
cd "$(dirname "$0")/../.." || exit 0
ROOT=$PWD
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
DRY=${GPU_DRY_RUN:-0}
if [ "$DRY" != 1 ]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "bench/gpu/run.sh: no CUDA device here (torch.cuda.is_available() is not True for $PY);" \
      "no GPU check to run, nothing written. (GPU_DRY_RUN=1 rehearses every part on the CPU.)"
    exit 0
  fi
fi

BUDGET=${GPU_BUDGET_S:-480}
START=$(date +%s)
STATE=$(mktemp -d /tmp/gpu_run.XXXXXX)
RESULTS=$ROOT/bench/results
[ "$DRY" = 1 ] && RESULTS=$STATE/results  # a rehearsal leaves the committed results alone
RESULTS=${GPU_RESULTS:-$RESULTS}
mkdir -p "$RESULTS"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
left() { echo $((BUDGET - ($(date +%s) - START))); }

# run_part NAME TIMEOUT_S CMD...: run under min(TIMEOUT_S, budget left), log to $STATE/NAME.log,
# record "NAME rc seconds" in $STATE/status (rc 124: ran out of time; "skipped": no time left).
run_part() {
  local name=$1 limit=$2
  shift 2
  local room
  room=$(left)
  [ "$room" -lt "$limit" ] && limit=$room
  if [ "$limit" -lt 20 ]; then
    echo "$name skipped 0" >>"$STATE/status"
    echo "== $name: skipped (the ${BUDGET} s budget is spent)"
    return
  fi
  echo "== $name (up to ${limit} s): $*"
  local t0=$(date +%s)
  # an inductor cache of its own: a part stopped while compiling can leave a truncated kernel
  TORCHINDUCTOR_CACHE_DIR=$STATE/inductor_$name \
    timeout --kill-after=15 "$limit" "$@" >"$STATE/$name.log" 2>&1
  local rc=$?
  echo "$name $rc $(($(date +%s) - t0))" >>"$STATE/status"
  echo "== $name: exit $rc after $(($(date +%s) - t0)) s"
  tail -n 5 "$STATE/$name.log"
}

CORES=$(nproc 2>/dev/null || echo 1)
GPU_PIN=()
CPU_PIN=()
if [ "$CORES" -ge 16 ] && command -v taskset >/dev/null; then
  GPU_PIN=(taskset -c 0-7)
  CPU_PIN=(taskset -c 8-15)
  export TORCHINDUCTOR_COMPILE_THREADS=8
fi

if [ "$DRY" = 1 ]; then
  export LZPP_GPU_DRY_RUN=1 TORCHINDUCTOR_COMPILE_THREADS=1
  ONE_B=(--device cpu --tiny --steps 2 --warmup 2 --budget-s 240 --row-timeout-s 200)
  BLOCKS=(--device cpu --tiny --rows 1 --repeats 2)
  ZEROPP4=(--worlds 4 --rows zeropp_u1,1f1b_keep --steps 1 --warmup 1)
  ZEROPP8=(--worlds 8 --rows zeropp_u1 --steps 1 --warmup 1)
else
  ONE_B=(--budget-s 310 --row-timeout-s 100)
  BLOCKS=(--rows 1,4 --repeats 10)
  ZEROPP4=(--worlds 4)
  ZEROPP8=(--worlds 8)
fi

zeropp_part() {  # bench_zeropp writes zeropp.md: keep the GPU machine's apart as gpu_zeropp_w*.md
  local world=$1 limit=$2
  shift 2
  mkdir -p "$STATE/zeropp_w$world"
  BENCH_RESULTS=$STATE/zeropp_w$world run_part "zeropp_w$world" "$limit" "${CPU_PIN[@]}" \
    "$PY" bench/bench_zeropp.py "$@"
  if [ -f "$STATE/zeropp_w$world/zeropp.md" ]; then
    cp "$STATE/zeropp_w$world/zeropp.md" "$RESULTS/gpu_zeropp_w$world.md"
  fi
}

ZEROPP_PID=
if [ ${#CPU_PIN[@]} -gt 0 ]; then  # beside the GPU parts, on cores of its own
  (zeropp_part 4 220 "${ZEROPP4[@]}"; zeropp_part 8 320 "${ZEROPP8[@]}") >"$STATE/zeropp.out" 2>&1 &
  ZEROPP_PID=$!
fi

run_part tests 140 "${GPU_PIN[@]}" "$PY" -m pytest -q -m gpu tests/distributed/test_gpu.py \
  -p no:cacheprovider --durations=10
BENCH_RESULTS=$RESULTS run_part bench_1b 330 "${GPU_PIN[@]}" "$PY" bench/gpu/bench_1b.py "${ONE_B[@]}"
BENCH_RESULTS=$RESULTS run_part blocks 80 "${GPU_PIN[@]}" "$PY" bench/gpu/block_times.py "${BLOCKS[@]}"

if [ -n "$ZEROPP_PID" ]; then
  wait "$ZEROPP_PID"
  cat "$STATE/zeropp.out"
else
  zeropp_part 4 "$(left)" "${ZEROPP4[@]}"
  zeropp_part 8 "$(left)" "${ZEROPP8[@]}"
fi

"$PY" bench/gpu/report.py --state "$STATE" --results "$RESULTS" --dry-run "$DRY" \
  --elapsed "$(($(date +%s) - START))"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  cp "$RESULTS"/gpu*.md "$OUT"/ 2>/dev/null
fi
echo "bench/gpu/run.sh: done in $(($(date +%s) - START)) s; see $RESULTS/gpu.md"
exit 0
