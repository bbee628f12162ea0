#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md ("GPU (H100)") and the CUDA tests, in one run.
# Run from the repository root on a CUDA host where kvserve is installed:
#   GPU_SHARED=../shared/gpu bash scripts/gpu/run.sh [tests] [figures] [diag]
# GPU_SHARED holds make_models.py (random-weight models with SmolLM2's tokenizer) and
# static_decode_anchor.py (the plain-torch CUDA-graph yardstick). Logs go to $OUT (default
# ./gpu-logs), one file per group.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
G=${GPU_SHARED:-../shared/gpu}
M=${MODELS:-/tmp/models}
python3 "$G/make_models.py" "$M" smol l1b 2>&1 | grep ready
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
KV="python3 -m kvserve.cli"
# run GROUP NAME TIMEOUT CMD...: full output appended to $OUT/GROUP.log, summary lines echoed
run() { local grp=$1 name=$2 t=$3; shift 3; echo "=== $name" | tee -a "$OUT/$grp.log"; local s=$SECONDS
  timeout "$t" "$@" >>"$OUT/$grp.log" 2>&1; echo "rc=$? ${name} $((SECONDS-s))s" | tee -a "$OUT/$grp.log"; }
for step in ${*:-tests figures diag}; do
case $step in
tests) run tests tests 300 env KVSERVE_CUDA_TEST_MODEL=$M/smol KVSERVE_TEST_TOKENIZER=$M/smol python3 -m pytest -q -p no:cacheprovider \
  tests/workers/test_cuda_path.py tests/workers/test_cuda_graphs.py tests/workers/test_triton_attention.py tests/workers/test_triton_fused.py
  tail -4 "$OUT/tests.log" ;;
figures)
  run figures anchor 120 python3 "$G/static_decode_anchor.py"
  run figures batched 200 $KV bench batched --model $M/l1b --npp 512 --ntg 128 --npl 1,64,256 --no-progress
  run figures batched2k 120 $KV bench batched --model $M/l1b --npp 2048 --ntg 128 --npl 64 --no-progress
  run figures throughput 240 $KV bench throughput --model $M/l1b --num-seqs 256 --input-len 256 --output-len 128 --max-num-seqs 256 --baseline hf --no-progress
  run figures pressure 200 $KV bench pressure --model $M/l1b --num-prompts 64 --input-len 512 --output-len 128 --baseline none --no-progress
  run figures pressure32 200 $KV bench pressure --model $M/l1b --num-prompts 64 --input-len 512 --output-len 128 --baseline none --dtype float32 --no-progress
  grep -E "^\|  |^rc=|graph .* ms/step|^kvserve|^hf_|roofline|GB/s|host_tier|unconstrained|recompute" "$OUT/figures.log" ;;
diag)
  run diag attn 150 python3 scripts/gpu/attention_kernels.py
  run diag eager 120 $KV bench batched --model $M/l1b --npp 512 --ntg 16 --npl 1,64 --enforce-eager --no-progress
  run diag torchattn 120 $KV bench batched --model $M/l1b --npp 512 --ntg 8 --npl 64 --attention-backend torch --enforce-eager --no-progress
  for b in 1 64 256; do run diag profile$b 100 python3 scripts/gpu/profile_step.py $M/l1b $b 512; done
  run diag engine256 120 python3 scripts/gpu/profile_engine.py $M/l1b 256
  run diag engine64 120 python3 scripts/gpu/profile_engine.py $M/l1b 64
  grep -E "^=== |^B=|splits=|engine B=|ms/step|build_step|^\|  |^rc=" "$OUT/diag.log" ;;
esac
done
