#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md ("GPU (H100, H200)") and the CUDA tests, in one run.
# Run from the repository root on a CUDA host where kvserve is installed (or from its checkout):
#   GPU_SHARED=../shared/gpu bash scripts/gpu/run.sh [tests] [figures] [diag] [engine]
# GPU_SHARED holds make_models.py (random-weight models with SmolLM2's tokenizer) and
# static_decode_anchor.py (the plain-torch CUDA-graph yardstick). Logs go to $OUT (default
# ./gpu-logs), one file per group.
#
# Quick (step `quick`, run first whenever a GPU is lent: one device call of at most 8
# minutes, scripts/gpu/quick.sh says what it runs): the CUDA tests of the round-two code,
# the yardstick and bench batched, bench pressure, bench throughput against the roofline
# with asynchronous scheduling on and off; $OUT/summary.txt sets each figure beside its target.
#   here, once, in the checkout the device tool sends (both folders git-ignored):
#     bash scripts/gpu/quick_wheels.sh && rm -rf .gpu && cp -r ../shared/gpu .gpu
#     QUICK_DRY=1 PY=.venv/bin/python bash scripts/gpu/run.sh quick   # the CPU dry run (~10 min)
#   the call: run(command="GPU_SHARED=.gpu bash scripts/gpu/run.sh quick",
#                 carry=[".whl/quick", ".gpu"], timeout_s=540)
#   then: the figures of summary.txt, with the device and date it names, into docs/benchmarks.md
#   ("GPU (H100, H200)"); quick.log holds every part's output.
#
# Engine (step `engine`, under a device call's 10 minutes): where the time goes in the
# pressure run and LLM.generate (scripts/gpu/profile_engine.py: torch.profiler and host
# timers), host work per decode step (bench hoststep), and asynchronous scheduling on and
# off (decode ms/step, LLM.generate, pressure). The default run is tests, figures, diag.
# Host tier (step `pressure`, about 10 minutes): `bench pressure` in interleaved rounds, bf16 and
# float32, with the restore cost model's choices and the copies' GB/s each way.
#
# Serving (steps wheels, servetest, serve, serve2, serve3, workers): `kvserve bench serve` side by
# side with the engine alone on the same GPU, the `kvserve serve` GPU end-to-end test, and
# two workers sharing the GPU against one. A GPU host without Ray gets it as wheels:
#   here, once:  bash scripts/gpu/wheels.sh && cp -r ../shared/gpu .gpu   (both git-ignored)
#   call 1, carry [.whl/call1, .gpu]:  GPU_SHARED=.gpu bash scripts/gpu/run.sh models
#   call 2 at once (same warm machine), carry [.whl/call2, .gpu]:
#                GPU_SHARED=.gpu bash scripts/gpu/run.sh wheels servetest serve
#   then, while it stays warm:  GPU_SHARED=.gpu bash scripts/gpu/run.sh serve2 workers
#   and:  GPU_SHARED=.gpu bash scripts/gpu/run.sh serve3
# `wheels` joins ray's two parts and installs every wheel with one `pip install --target
# /tmp/site`; later steps and calls on that machine find /tmp/site and put it on PYTHONPATH.
# Each of these steps stays under a device call's 10 minutes.
# MoE (step moe): GPU_SHARED=.gpu bash scripts/gpu/run.sh moe  (the fused-MoE kernels' tests,
# the kernels vs the grouped torch path, a 5B Qwen3-MoE's decode vs transformers; ~10 min).
# Tensor parallelism (step tp, a host with 2+ GPUs): the NCCL tests (size 2 against one GPU,
# eager and in CUDA graphs; a killed rank), then `bench tp` at sizes 1, 2 (and 4 with 4 GPUs)
# on the Llama-3.2-1B-shape model; on one GPU the tests report "needs 2 CUDA GPUs".
set -u
# quick: its own script (scripts/gpu/quick.sh: its wheels, models, budget and summary)
if [ "${1:-}" = quick ]; then shift; exec bash scripts/gpu/quick.sh "$@"; fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
G=${GPU_SHARED:-../shared/gpu}
M=${MODELS:-/tmp/models}
SITE=/tmp/site  # the wheels step's install: Ray and what Serve needs
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 "$G/make_models.py" "$M" smol l1b 2>&1 | grep ready
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
KV="python3 -m kvserve.cli"
# the serving figures' load: 256 prompts of 256 tokens, 128 out; KV and batch for 256 streams
SERVE_LOAD="--num-prompts 256 --random-input-len 256 --random-output-len 128 --max-num-seqs 256 --kv-cache-tokens 131072 --no-progress"
# run GROUP NAME TIMEOUT CMD...: full output appended to $OUT/GROUP.log, summary lines echoed
run() { local grp=$1 name=$2 t=$3; shift 3; echo "=== $name" | tee -a "$OUT/$grp.log"; local s=$SECONDS
  timeout "$t" "$@" >>"$OUT/$grp.log" 2>&1; echo "rc=$? ${name} $((SECONDS-s))s" | tee -a "$OUT/$grp.log"; }
for step in ${*:-tests figures diag}; do
case $step in
models) ;;  # the models above only
wheels) W=${WHEELS:-.whl}; ray=$(basename "$(ls "$W"/call1/ray-*.whl.part-00)" .part-00)
  cat "$W"/call1/"$ray".part-00 "$W"/call2/"$ray".part-01 > "/tmp/$ray"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$W"/call1/*.whl "/tmp/$ray" || exit 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c "import ray, ray.serve, ray.dashboard.optional_deps, grpc, google.protobuf, pydantic, openai; print('wheels: ray', ray.__version__, 'grpc', grpc.__version__, 'protobuf', google.protobuf.__version__)" ;;
servetest) run servetest servetest 400 env KVSERVE_CUDA_TEST_MODEL=$M/smol KVSERVE_TEST_TOKENIZER=$M/smol \
  python3 -m pytest -q -p no:cacheprovider tests/deploy/test_serve_gpu.py
  tail -4 "$OUT/servetest.log" ;;
serve)  # gRPC streaming vs the engine alone at concurrency 64 and 256, 256 prompts 256 -> 128
  for c in 64 256; do run serve grpc$c 280 $KV bench serve --model $M/l1b --compare-engine --target grpc \
    --max-concurrency $c $SERVE_LOAD --save-result "$OUT/serve_grpc$c.json"; done
  grep -E "^=== |^rc=|/ engine|starting the service" "$OUT/serve.log" ;;
serve2)  # OpenAI HTTP streaming vs the engine at 64; TTFT overhead at concurrency 1
  run serve2 http64 280 $KV bench serve --model $M/l1b --compare-engine --target http \
    --max-concurrency 64 $SERVE_LOAD --save-result "$OUT/serve_http64.json"
  run serve2 ttft1 280 $KV bench serve --model $M/l1b --compare-engine --target grpc \
    --max-concurrency 1 $SERVE_LOAD --num-prompts 32 --save-result "$OUT/serve_ttft1.json"
  grep -E "^=== |^rc=|/ engine|starting the service" "$OUT/serve2.log" ;;
serve3)  # TTFT at concurrency 1 with asynchronous scheduling off (serve2's ttft1 has it on)
  run serve3 ttft1_sync 280 $KV bench serve --model $M/l1b --compare-engine --target grpc \
    --max-concurrency 1 $SERVE_LOAD --num-prompts 32 --async-scheduling off --save-result "$OUT/serve_ttft1_sync.json"
  grep -E "^=== |^rc=|/ engine|starting the service" "$OUT/serve3.log" ;;
workers)  # two workers sharing the GPU (0.5 each, half the KV each) vs one with half the KV
  run workers workers2 560 $KV bench serve --model $M/l1b --compare-workers --workers 2 \
    --gpus-per-worker 0.5 --target grpc --max-concurrency 256 $SERVE_LOAD --rounds 2 \
    --save-result "$OUT/serve_workers.json"
  grep -E "^=== |^rc=|^[0-9] +[12] worker|worker.*medians|starting the service|resized" "$OUT/workers.log" ;;
tp)  # tensor parallelism over this host's GPUs
  run tp tptests 500 env KVSERVE_TEST_TOKENIZER=$M/smol python3 -m pytest -q -rs -p no:cacheprovider \
    tests/workers/test_cuda_tensor_parallel.py
  n=$(nvidia-smi -L | wc -l); sizes=1,2; [ "$n" -ge 4 ] && sizes=1,2,4
  [ "$n" -ge 2 ] && run tp benchtp 500 $KV bench tp --model $M/l1b --sizes $sizes --batch 1,64 \
    --dtype bfloat16 --steps 32 --json "$OUT/bench_tp.json"
  grep -E "^=== |^rc=|passed|failed|skipped|^ *[0-9]+ +[0-9]+ " "$OUT/tp.log" ;;
moe)  # Qwen3-MoE, random weights (make_moe_models.py q3moe: 5.2B, 64 experts, top-8): the
  # fused-MoE kernels on the GPU, against the grouped torch path, and decode B=1/64 vs transformers
  python3 scripts/gpu/make_moe_models.py "$M" "$G/tokenizer" q3moe 2>&1 | grep ready
  run moe moetests 300 python3 -m pytest -q -p no:cacheprovider tests/workers/test_triton_moe.py
  run moe kernels 300 python3 scripts/gpu/moe_kernels.py
  run moe decode 500 python3 scripts/gpu/moe_decode.py $M/q3moe
  grep -E "^=== |^rc=|passed|failed|^== |^ +[0-9]+ |^kvserve|^transformers|^B=" "$OUT/moe.log" ;;
tests) run tests tests 400 env KVSERVE_CUDA_TEST_MODEL=$M/smol KVSERVE_TEST_TOKENIZER=$M/smol python3 -m pytest -q -m '' -p no:cacheprovider \
  tests/workers/test_cuda_path.py tests/workers/test_cuda_graphs.py tests/workers/test_triton_attention.py tests/workers/test_triton_fused.py \
  tests/workers/test_async_scheduling.py tests/kvcache/test_block_tables.py \
  tests/kvcache/test_host_copies.py tests/workers/test_restore_policy.py tests/kvcache/test_kv_transport.py
  tail -4 "$OUT/tests.log" ;;
figures)
  run figures anchor 120 python3 "$G/static_decode_anchor.py"
  run figures batched 200 $KV bench batched --model $M/l1b --npp 512 --ntg 128 --npl 1,64,256 --no-progress
  run figures batched2k 120 $KV bench batched --model $M/l1b --npp 2048 --ntg 128 --npl 64 --no-progress
  run figures throughput 240 $KV bench throughput --model $M/l1b --num-seqs 256 --input-len 256 --output-len 128 --max-num-seqs 256 --baseline hf --no-progress
  run figures pressure 200 $KV bench pressure --model $M/l1b --num-prompts 64 --input-len 512 --output-len 128 --baseline none --rounds 1 --no-progress
  run figures pressure32 200 $KV bench pressure --model $M/l1b --num-prompts 64 --input-len 512 --output-len 128 --baseline none --rounds 1 --dtype float32 --no-progress
  run figures hoststep 120 $KV bench hoststep --model $M/l1b --batch 64,256 --steps 30
  grep -E "^\|  |^rc=|graph .* ms/step|^kvserve|^hf_|roofline|GB/s|host_tier|unconstrained|recompute" "$OUT/figures.log" ;;
pressure)  # the host tier at 50% of the KV need: interleaved rounds, the cost model's choices,
  # copy GB/s each way (CUDA events), in bf16 and float32; then copies forced, for their GB/s
  PR="$KV bench pressure --model $M/l1b --num-prompts 64 --input-len 512 --output-len 128 --baseline none --no-progress"
  run pressure pressure 280 $PR --rounds 2
  run pressure pressure32 280 $PR --rounds 2 --dtype float32
  run pressure pressure_copy 150 $PR --rounds 1 --restore-policy copy
  grep -E "^=== |^rc=|GB/s|^host tier|^(unconstrained|recompute|host_tier) |^ +rounds|^per token" "$OUT/pressure.log" ;;
diag)
  run diag attn 150 python3 scripts/gpu/attention_kernels.py
  run diag eager 120 $KV bench batched --model $M/l1b --npp 512 --ntg 16 --npl 1,64 --enforce-eager --no-progress
  run diag torchattn 120 $KV bench batched --model $M/l1b --npp 512 --ntg 8 --npl 64 --attention-backend torch --enforce-eager --no-progress
  for b in 1 64 256; do run diag profile$b 100 python3 scripts/gpu/profile_step.py $M/l1b $b 512; done
  run diag engine256 120 python3 scripts/gpu/profile_engine.py $M/l1b 256
  run diag engine64 120 python3 scripts/gpu/profile_engine.py $M/l1b 64
  grep -E "^=== |^B=|splits=|engine B=|ms/step|build_step|^\|  |^rc=" "$OUT/diag.log" ;;
engine)  # where the time goes (profiles), and asynchronous scheduling on and off
  P=scripts/gpu/profile_engine.py
  for a in on off; do run engine decode256_async_$a 90 python3 $P $M/l1b 256 --async-scheduling $a --steps 50; done
  run engine generate 120 python3 $P $M/l1b --workload generate --num-prompts 256 --input-len 256 --output-len 128
  run engine pressure_host 120 python3 $P $M/l1b --workload pressure --num-prompts 64 --input-len 512 --output-len 128
  run engine pressure_recompute 100 python3 $P $M/l1b --workload pressure --num-prompts 64 --input-len 512 --output-len 128 --host-gib 0
  run engine throughput_sync 120 $KV bench throughput --model $M/l1b --num-seqs 256 --input-len 256 --output-len 128 --max-num-seqs 256 --async-scheduling off --no-progress
  grep -E "^=== |^rc=|^device|^engine B=|^(generate|pressure):|^wall |^steps:|%$|^  Memcpy|^host sync|^kvserve|roofline" "$OUT/engine.log" ;;
esac
done
