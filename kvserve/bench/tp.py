"""`kvserve bench tp`: the same prompts at several tensor-parallel sizes.

For each size one engine (its ranks share `--threads` CPU threads); for each batch B random
prompts (greedy, EOS ignored) are prefilled, then `--steps` decode steps of all B streams are
timed. Per step: the wall time, and rank 0's collectives (all-reduces after o_proj and
down_proj, the embedding's, the LM head's gather): their count, wall time (on the CPU; it
includes waiting for the slowest rank) and payload. Each size's greedy tokens are checked
against the first size's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from kvserve.bench.common import machine_info, random_prompts, write_json


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("tp", help="tensor-parallel sizes: step time, collectives, same tokens")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    p.add_argument("--sizes", default="1,3", help="tensor-parallel sizes (comma list)")
    p.add_argument("--batch", default="1,8", help="streams decoding together (comma list)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of all ranks together")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=cmd_tp)


def measure(engine: Any, batch: int, input_len: int, steps: int) -> dict[str, Any]:
    """Decode-step figures of `batch` streams, and their greedy tokens."""
    from kvserve.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in
           random_prompts(batch, input_len, engine.model_config.vocab_size, seed=batch)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}

    def take(outs: list[Any]) -> None:
        for o in outs:
            tokens[o.request_id].extend(o.delta_token_ids)

    while any(not tokens[i] for i in ids):  # prefill: every stream has its first token
        take(engine.step())
    wall, coll, calls, sent = [], [], [], []
    for _ in range(steps):
        s0 = engine.stats()
        t0 = time.perf_counter()
        take(engine.step())
        wall.append(time.perf_counter() - t0)
        s1 = engine.stats()
        coll.append(s1.get("tp_collective_seconds", 0.0) - s0.get("tp_collective_seconds", 0.0))
        calls.append(s1.get("tp_collectives", 0) - s0.get("tp_collectives", 0))
        sent.append(s1.get("tp_collective_bytes", 0) - s0.get("tp_collective_bytes", 0))
    ms = 1e3
    return {"batch": batch, "steps": steps, "step_ms_median": statistics.median(wall) * ms,
            "step_ms_min": min(wall) * ms, "collective_ms_median": statistics.median(coll) * ms,
            "collectives_per_step": statistics.median(calls),
            "collective_kib_per_step": statistics.median(sent) / 1024,
            "tokens": [tokens[i] for i in ids]}


def cmd_tp(args: argparse.Namespace) -> int:
    from kvserve.config import EngineConfig
    from kvserve.workers.engine.engine import LLMEngine

    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
        batches = [int(x) for x in args.batch.split(",") if x.strip()]
    except ValueError:
        print("--sizes and --batch take comma lists of integers", file=sys.stderr)
        return 2
    if not sizes or not batches or min(sizes + batches) < 1 or args.steps < 1:
        print("--sizes, --batch and --steps must be positive", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    first: dict[int, list[list[int]]] = {}
    print(f"{'size':>4} {'B':>4} {'ms/step (median/min)':>21} {'collectives':>11} "
          f"{'coll. ms/step':>13} {'coll. share':>11} {'KiB/step':>9} {'tokens':>7}")
    for size in sizes:
        cfg = EngineConfig(model=args.model, tensor_parallel_size=size, num_threads=args.threads,
                           dtype=args.dtype, max_num_seqs=max(batches), host_cache_gib=0,
                           kv_cache_tokens=max(batches) * (args.input_len + args.steps + 32))
        engine = LLMEngine(cfg)
        try:
            for b in batches:
                r = measure(engine, b, args.input_len, args.steps)
                same = first.setdefault(b, r["tokens"]) == r["tokens"]
                r.update(size=size, same_tokens=same)
                rows.append(r)
                share = r["collective_ms_median"] / r["step_ms_median"]
                print(f"{size:>4} {b:>4} {r['step_ms_median']:>12.1f} /{r['step_ms_min']:>7.1f} "
                      f"{r['collectives_per_step']:>11.0f} {r['collective_ms_median']:>13.1f} "
                      f"{share:>10.0%} {r['collective_kib_per_step']:>9.1f} "
                      f"{'same' if same else 'DIFFER':>7}")
        finally:
            engine.close()
    write_json(args.json, {"bench": "tp", "model": args.model, "input_len": args.input_len,
                           "results": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
                           "machine": machine_info(args.threads)})
    return 0 if all(r["same_tokens"] for r in rows) else 1
