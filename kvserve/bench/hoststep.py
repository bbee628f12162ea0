"""`kvserve bench hoststep`: the engine's host-side work per steady decode step.

B requests (random prompts, greedy, EOS ignored) are prefilled, then `LLMEngine.step` runs
decode steps for all B streams at once. Each step's host time is its wall time minus the
model's forward (attention metadata and kernels included, the part a GPU replays as a CUDA
graph), with the step-input build (`build_step`, timed where the forward calls it) counted
back in as host work: scheduling, KV reservation and commit, sampling, stop checks,
detokenization and the outputs. A model
with a tiny forward (e.g. a random hidden-64 Llama) keeps the subtraction small. Both the
wall time and the thread's CPU time are reported; on a busy machine the CPU time is the
steadier figure (the step runs on one thread with --threads 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from kvserve.bench.common import (
    add_async_arg,
    async_value,
    machine_info,
    random_prompts,
    write_json,
)


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("hoststep", help="host (Python) time per engine decode step")
    p.add_argument("--batch", default="64,256", help="streams decoding together (comma list)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=50, help="decode steps timed per batch")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=1)
    add_async_arg(p)
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=cmd_hoststep)


def measure(model: str | None, batch: int, input_len: int, steps: int,
            threads: int, async_scheduling: bool | None = None) -> dict[str, Any]:
    """Host milliseconds per decode step at `batch` streams (wall and CPU, median and min)."""
    from kvserve.config import EngineConfig
    from kvserve.sampling import SamplingParams
    from kvserve.workers.engine.engine import LLMEngine
    from kvserve.workers.model import runner as runner_mod

    # enough tokens that no stream finishes while the timed steps run, however late it was
    # admitted during prefill
    max_tokens = steps + 64
    total = input_len + max_tokens
    eng = LLMEngine(EngineConfig(model=model, max_num_seqs=batch, num_threads=threads,
                                 kv_cache_tokens=batch * (total + 16), host_cache_gib=0,
                                 max_num_batched_tokens=max(2048, input_len),
                                 async_scheduling=async_scheduling))
    runner = eng.runner
    spent = [0.0, 0.0]  # forward seconds (wall, thread CPU) in the current step, less its build
    forward = runner._forward
    build = runner_mod.build_step

    def timed_forward(plan: Any, *rest: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = forward(plan, *rest)
        spent[0] += time.perf_counter() - t0
        spent[1] += time.thread_time() - c0
        return out

    def timed_build(*args: Any) -> Any:
        # the step-input build inside the forward is host work: counted back in
        t0, c0 = time.perf_counter(), time.thread_time()
        out = build(*args)
        spent[0] -= time.perf_counter() - t0
        spent[1] -= time.thread_time() - c0
        return out

    runner._forward = timed_forward  # type: ignore[method-assign]
    runner_mod.build_step = timed_build  # type: ignore[assignment]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for ids in random_prompts(batch, input_len, eng.model_config.vocab_size, seed=0):
        eng.add_request(ids, params)
    while eng.scheduler.waiting or any(not s.output_ids for s in eng.scheduler.running):
        eng.step()
    eng.step()  # first pure decode step: warm caches
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(steps):
        spent[0] = spent[1] = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = eng.step()
        wall.append(time.perf_counter() - t0 - spent[0])
        cpu.append(time.thread_time() - c0 - spent[1])
        if len(outs) != batch:
            raise RuntimeError(f"a decode step returned {len(outs)} outputs for {batch} streams")
    runner_mod.build_step = build  # type: ignore[assignment]
    ms = 1e3
    return {"batch": batch, "steps": steps,
            "wall_ms_median": statistics.median(wall) * ms, "wall_ms_min": min(wall) * ms,
            "cpu_ms_median": statistics.median(cpu) * ms, "cpu_ms_min": min(cpu) * ms,
            "cpu_us_per_stream": statistics.median(cpu) / batch * 1e6}


def cmd_hoststep(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    try:
        batches = [int(x) for x in args.batch.split(",") if x.strip()]
    except ValueError:
        print(f"--batch: expected a comma list of integers, got {args.batch!r}", file=sys.stderr)
        return 2
    if not batches or min(batches) < 1 or args.steps < 1 or args.input_len < 1:
        print("--batch, --steps and --input-len must be positive", file=sys.stderr)
        return 2
    rows = []
    print(f"{'B':>5} {'wall ms (median/min)':>21} {'CPU ms (median/min)':>20} {'CPU us/stream':>14}")
    for b in batches:
        r = measure(args.model, b, args.input_len, args.steps, args.threads,
                    async_value(args.async_scheduling))
        rows.append(r)
        print(f"{b:>5} {r['wall_ms_median']:>12.3f} /{r['wall_ms_min']:>7.3f} "
              f"{r['cpu_ms_median']:>11.3f} /{r['cpu_ms_min']:>7.3f} {r['cpu_us_per_stream']:>14.2f}")
    write_json(args.json, {"bench": "hoststep", "results": rows,
                           "machine": machine_info(args.threads)})
    return 0
