#!/usr/bin/env bash
# `bash scripts/gpu/run.sh quick [STEP...]`: the GPU path's checks and figures in one device
# call, from a bare GPU machine, in at most QUICK_BUDGET seconds (480) of wall time.
#   wheels      the wheels in .whl/quick (scripts/gpu/quick_wheels.sh) into /tmp/site
#   models      the random-weight smol model (GPU_SHARED's make_models.py) in /tmp/models; the
#               l1b model (Llama-3.2-1B shape) is made beside it and the tests, in the background
#   tests       the CUDA tests that guard persistent block tables, the block-major host pool's
#               copies, asynchronous scheduling, mixed-step CUDA graphs and restore by measured
#               cost (their CPU-only cases and the two that need Ray left out; at most 170 s)
#   anchor      the plain-torch CUDA-graph yardstick (GPU_SHARED's static_decode_anchor.py)
#   batched     bench batched, l1b in bf16: B 1/64/256 at ctx 512, B 64 at ctx 2048
#   pressure    bench pressure in bf16, one round: unconstrained, recompute, host tier at half
#               the KV need (copy GB/s each way, the cost model's choices)
#   throughput  bench throughput, 256 x 256 -> 128 (LLM.generate's path against the decode
#               roofline), asynchronous scheduling on, then off
# Default: all of them, in this order. Each timed part runs under its own timeout, cut to what
# is left of the budget (a part with under 20 s left is skipped), and the summary is rewritten
# after each, so a cut run still reports what it measured.
# Out: $OUT/quick.log (every part's output), $OUT/summary.txt (each figure next to its target,
# by scripts/gpu/quick_summary.py) and $OUT/results.json (the figures read): 3 files, where a
# device call brings back at most 8. The parts' own files stay in QUICK_WORK (/tmp/quick).
#
# `plan` as the only step prints each part's command line and timeout, and runs nothing.
# QUICK_DRY=1 (with PY=.venv/bin/python): the dry run on a CPU host. The wheels install into a
# temporary --target for CPython 3.12 (tags and duplicates checked); every later part runs in
# a look-alike of the GPU image (scripts/gpu/image_venv.py: the image's packages and the
# wheels', nothing else); smol is the only model; the tests are collected, not run; the
# yardstick parses its arguments only; the benches run with the same flags at tiny sizes on
# smol. Timeouts are 6x and the budget 2400 s there (the CPU host is not the GPU machine).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-gpu-logs}
G=${GPU_SHARED:-.gpu}
M=${MODELS:-/tmp/models}
W=${QUICK_WHEELS:-.whl/quick}
QW=${QUICK_WORK:-/tmp/quick}
PY=${PY:-python3}
DRY=${QUICK_DRY:-0}
STEPS="wheels models tests anchor batched pressure throughput"
SITE=/tmp/site
# the round-two code's own tests first: a cut run loses the older kernels' tests
TESTS="tests/kvcache/test_block_tables.py tests/kvcache/test_host_copies.py
  tests/workers/test_cuda_path.py tests/workers/test_async_scheduling.py
  tests/workers/test_restore_policy.py tests/workers/test_cuda_graphs.py
  tests/workers/test_triton_attention.py tests/kvcache/test_kv_transport.py"
# CPU-only cases ([cpu] parameters; the GPU machine's CPU adds nothing to CI's) and the Ray
# metrics' tests (no Ray there)
TEST_SELECT="not cpu and not worker_metric"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# each timed part's timeout (s); they add up to more than the budget, which cuts the last ones
declare -A CAP=([wheels]=60 [models]=60 [tests]=170 [anchor]=60 [batched]=110 [batched2k]=70
  [pressure]=140 [throughput_on]=80 [throughput_off]=70 [models_l1b]=150)
PARTS="wheels models models_l1b tests anchor batched batched2k pressure throughput_on throughput_off"

plan=0
if [ "$*" = plan ]; then plan=1; set --; fi
for s in "$@"; do
  case " $STEPS " in *" $s "*) ;; *)
    echo "quick: unknown step '$s' (steps: $STEPS; or plan alone)" >&2; exit 2 ;; esac
done
todo=" ${*:-$STEPS} "

if [ "$DRY" = 1 ]; then  # the same flags at tiny sizes on the CPU
  BUDGET=${QUICK_BUDGET:-2400}; SCALE=6
  MODEL=$M/smol; NPL=1,2; NPP=16; NTG=4; NPL2K=2; NPP2K=32
  TPUT="--num-seqs 4 --input-len 16 --output-len 8 --max-num-seqs 4"
  PRES="--num-prompts 4 --input-len 32 --output-len 8"
  ANCHOR_ARGS="--help"; COLLECT="--collect-only"
else
  BUDGET=${QUICK_BUDGET:-480}; SCALE=1
  MODEL=$M/l1b; NPL=1,64,256; NPP=512; NTG=128; NPL2K=64; NPP2K=2048
  TPUT="--num-seqs 256 --input-len 256 --output-len 128 --max-num-seqs 256"
  PRES="--num-prompts 64 --input-len 512 --output-len 128"
  ANCHOR_ARGS=""; COLLECT=""
fi
RESERVE=10  # seconds kept for the last summary
KV="@PY -m kvserve.cli"

# PART: its command line (@PY: the python of the moment, which the dry run changes)
# shellcheck disable=SC2086  # $TESTS: one line of file names
cmd_of() {
  case $1 in
  wheels) if [ "$DRY" = 1 ]; then
      echo "@PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $QW/site --python-version 3.12 --implementation cp --abi cp312 $PLATFORMS --only-binary=:all: $W/*.whl"
    else
      echo "@PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $W/*.whl"
    fi ;;
  models) echo "@PY $G/make_models.py $M smol" ;;
  models_l1b) echo "@PY $G/make_models.py $M l1b" ;;
  tests) echo "env KVSERVE_CUDA_TEST_MODEL=$M/smol KVSERVE_TEST_TOKENIZER=$M/smol @PY -m pytest -v -rfEs -p no:cacheprovider --durations=15 @TIMEOUT --junitxml=$QW/tests.xml $COLLECT -k @SELECT" $TESTS ;;
  anchor) echo "@PY $G/static_decode_anchor.py $ANCHOR_ARGS" ;;
  batched) echo "$KV bench batched --model $MODEL --npp $NPP --ntg $NTG --npl $NPL --no-progress --json $QW/batched.json" ;;
  batched2k) echo "$KV bench batched --model $MODEL --npp $NPP2K --ntg $NTG --npl $NPL2K --no-progress --json $QW/batched2k.json" ;;
  pressure) echo "$KV bench pressure --model $MODEL $PRES --baseline none --rounds 1 --dtype bfloat16 --no-progress --json $QW/pressure.json" ;;
  throughput_on) echo "$KV bench throughput --model $MODEL $TPUT --async-scheduling on --no-progress --json $QW/throughput_on.json" ;;
  throughput_off) echo "$KV bench throughput --model $MODEL $TPUT --async-scheduling off --no-progress --json $QW/throughput_off.json" ;;
  esac
}
TIMEOUT=""  # pytest-timeout's per-test limit, where the plugin is there (the GPU image has it)
# the command as run: a word list, split on blanks with the wheels globbed (the -k
# expression is one word)
# shellcheck disable=SC2206
words() {
  local c; c=$(cmd_of "$1"); c=${c//@PY/$PY}; c=${c//@TIMEOUT/$TIMEOUT}
  CMD=(${c%%@SELECT*})
  if [ "$c" != "${c%%@SELECT*}" ]; then CMD+=("$TEST_SELECT"); CMD+=(${c#*@SELECT}); fi
}

if [ "$plan" = 1 ]; then
  total=0
  for p in $PARTS; do
    words "$p"; t=$((CAP[$p] * SCALE))
    printf '%s (timeout %d s%s):' "$p" "$t" "$([ "$p" = models_l1b ] && echo ', beside the tests')"
    printf ' %q' "${CMD[@]}"; echo
    [ "$p" = models_l1b ] || total=$((total + t))
  done
  echo "timeouts add up to $total s; the budget is $BUDGET s (the last parts get what is left)"
  exit 0
fi

if [ "$DRY" != 1 ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "quick: no GPU here (nvidia-smi -L failed); QUICK_DRY=1 runs the CPU dry run" >&2; exit 2
fi
mkdir -p "$OUT" "$QW"
rm -rf "$QW"/*.json "$QW"/*.log "$QW"/tests.xml "$QW"/steps.tsv
LOG=$OUT/quick.log
DEADLINE=$((SECONDS + BUDGET))
summary() { "$PY" scripts/gpu/quick_summary.py "$QW" "$OUT" || echo "quick: the summary failed" >&2; }
[ -d "$SITE" ] && [ "$DRY" != 1 ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# run PART: its command under its timeout; output to $QW/PART.log and $OUT/quick.log
run() {
  local p=$1 left=$((DEADLINE - SECONDS - RESERVE)) t=$((CAP[$1] * SCALE)) s=$SECONDS rc
  [ "$left" -lt "$t" ] && t=$left
  if [ "$t" -lt 20 ]; then
    echo "=== $p: skipped, $left s left of the budget" | tee -a "$LOG"
    printf '%s\tskipped\t0\t0\n' "$p" >> "$QW/steps.tsv"; return 1
  fi
  words "$p"
  echo "=== $p (timeout $t s): ${CMD[*]}" | tee -a "$LOG"
  timeout -k 10 "$t" "${CMD[@]}" 2>&1 | tee -a "$LOG" > "$QW/$p.log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$p" "$rc" $((SECONDS - s)) "$t" >> "$QW/steps.tsv"
  echo "rc=$rc $p $((SECONDS - s)) s" | tee -a "$LOG"
  summary
  return "$rc"
}
# the l1b model, made beside the tests; waited for before the first bench that loads it
L1B_PID=""
make_l1b() {
  words models_l1b
  echo "=== models_l1b (background, timeout ${CAP[models_l1b]} s): ${CMD[*]}" | tee -a "$LOG"
  L1B_START=$SECONDS
  timeout -k 10 "${CAP[models_l1b]}" "${CMD[@]}" > "$QW/models_l1b.log" 2>&1 &
  L1B_PID=$!
}
need_l1b() {
  if [ -z "$L1B_PID" ]; then  # not started beside the tests: made here, unless it is there
    [ "$DRY" = 1 ] || [ -f "$M/l1b/config.json" ] || run models_l1b
    return 0
  fi
  wait "$L1B_PID"; local rc=$?
  printf '%s\t%s\t%s\t%s\n' models_l1b "$rc" $((SECONDS - L1B_START)) "${CAP[models_l1b]}" >> "$QW/steps.tsv"
  cat "$QW/models_l1b.log" >> "$LOG"
  echo "rc=$rc models_l1b (ready $((SECONDS - L1B_START)) s after its start)" | tee -a "$LOG"
  L1B_PID=""
}

{ if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | head -1
  else echo "no GPU (dry run on $(uname -n))"; fi
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} | paste -sd ';' | sed 's/;/; /' > "$QW/device.txt"
echo "quick: $(cat "$QW/device.txt"); steps:$todo; budget $BUDGET s" | tee -a "$LOG"

for step in $STEPS; do
  case $todo in *" $step "*) ;; *) continue ;; esac
  case $step in
  wheels)
    if ! ls "$W"/*.whl >/dev/null 2>&1; then
      echo "quick: no wheels in $W: run bash scripts/gpu/quick_wheels.sh here first" | tee -a "$LOG"; exit 1
    fi
    rm -rf "$QW/site"
    run wheels || exit 1
    if [ "$DRY" = 1 ]; then
      PY=$("$PY" scripts/gpu/image_venv.py "$QW/venv" "$W" 2>>"$LOG") || exit 1
      echo "quick: the later parts run in $PY (the GPU image's packages and the wheels')" | tee -a "$LOG"
    else
      export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "import pydantic, jsonschema, xgrammar, kvserve.cli; print('quick: wheels import: pydantic', pydantic.VERSION)" 2>&1 | tee -a "$LOG" ;;
  models)  # l1b in the background from here, smol at once
    [ "$DRY" = 1 ] || [ -f "$M/l1b/config.json" ] || make_l1b
    run models ;;
  tests)
    "$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT="--timeout=60"
    run tests ;;
  anchor) run anchor ;;
  batched) need_l1b; run batched; run batched2k ;;
  pressure) need_l1b; run pressure ;;
  throughput) need_l1b; run throughput_on; run throughput_off ;;
  esac
done
need_l1b
summary
cat "$OUT/summary.txt"
