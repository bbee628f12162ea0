"""`kvserve bench throughput`: offline throughput on requests of mixed lengths.

All requests arrive at once (as in vLLM's `benchmark_throughput`): random-token prompts
with lengths drawn from --input-len LO:HI, each generating exactly a length drawn from
--output-len LO:HI (greedy, EOS ignored). `--baseline hf` runs the same requests, with the
same per-request output lengths, through transformers' continuous batching in this process,
and prints kvserve's speed-up. FLOP figures count the linear layers (2 x weights per token)
plus attention over each token's own context.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvserve.bench.common import (
    VOCAB_MARGIN,
    Timer,
    add_async_arg,
    async_value,
    available_cores,
    figures,
    identical,
    machine_info,
    progress_bar,
    write_json,
)

# this CPU's measured limits (2 threads), for the roofline fraction
ISSUE_GFLOPS = 68.0


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("throughput", help="offline throughput on mixed-length requests")
    p.add_argument("--num-seqs", type=int, default=64, help="number of requests")
    p.add_argument("--input-len", default="32:256", help="prompt tokens: N or LO:HI (uniform)")
    p.add_argument("--output-len", default="32:256", help="output tokens: N or LO:HI (uniform)")
    p.add_argument("--baseline", choices=["hf"], default=None,
                   help="also run the requests through transformers' continuous batching")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="device KV pool in tokens (default: the whole workload's, so no preemption)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--cpu-matmul", choices=["int8", "exact"], default="int8",
                   help="CPU on GGUF blocks: 8-bit activations (int8, the engine's default) or "
                        "float32 ones (exact: transformers' greedy tokens)")
    add_async_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--json-schema-share", type=float, default=0.0, metavar="F",
                   help="instead: run the workload unconstrained, then with this share of the "
                        "requests constrained to a JSON schema, and compare their step times")
    p.add_argument("--rounds", type=int, default=3,
                   help="--json-schema-share: alternating passes of each kind")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the schema for --json-schema-share (default: a long array of records)")
    p.set_defaults(func=cmd_throughput)


def parse_range(s: str) -> tuple[int, int]:
    """'N' or 'LO:HI' (inclusive) -> (lo, hi); raises ValueError on nonsense."""
    parts = s.split(":")
    if len(parts) not in (1, 2) or not all(x.strip().isdigit() for x in parts):
        raise ValueError(f"expected N or LO:HI, got {s!r}")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1 or hi < lo:
        raise ValueError(f"expected 1 <= LO <= HI, got {s!r}")
    return lo, hi


def make_workload(
    num: int, inp: tuple[int, int], out: tuple[int, int], vocab: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """Random prompts (ids away from special tokens) and per-request output lengths."""
    import torch

    g = torch.Generator().manual_seed(seed)
    in_lens = torch.randint(inp[0], inp[1] + 1, (num,), generator=g).tolist()
    out_lens = torch.randint(out[0], out[1] + 1, (num,), generator=g).tolist()
    lo = min(VOCAB_MARGIN, vocab // 4)
    prompts = [torch.randint(lo, vocab - lo, (n,), generator=g).tolist() for n in in_lens]
    return prompts, out_lens


def workload_gflop(cfg: Any, prompts: list[list[int]], out_lens: list[int]) -> float:
    """FLOPs of the whole workload: linear layers, lm_head on each generated token, attention."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter  # qkv, o, gate/up/down
    linear = 2 * layers * per_layer
    head = 2 * h * cfg.vocab_size
    total = 0.0
    for p, n in zip(prompts, out_lens, strict=True):
        tokens = len(p) + n - 1  # the last generated token is never fed back
        ctx = tokens * (tokens + 1) / 2  # sum of context lengths over the stream's tokens
        total += tokens * linear + n * head + 4 * layers * cfg.num_heads * cfg.head_dim * ctx
    return total / 1e9


def run_kvserve(
    args: argparse.Namespace, threads: int, inp: tuple[int, int], out: tuple[int, int]
) -> tuple[dict[str, Any], list[list[int]], list[int], list[list[int]], Any]:
    """Load the engine, draw the workload from its vocabulary, time it; returns (figures,
    prompts, output lengths, output ids, model config)."""
    from kvserve.config import EngineConfig
    from kvserve.sampling import SamplingParams
    from kvserve.workers.engine.engine import LLMEngine

    t0 = time.perf_counter()
    kv_tokens = args.kv_cache_tokens or max(32768, args.num_seqs * (inp[1] + out[1] + 16))
    engine = LLMEngine(EngineConfig(
        model=args.model, num_threads=threads, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=kv_tokens,
        enforce_eager=args.enforce_eager, async_scheduling=async_value(args.async_scheduling),
        cpu_matmul=args.cpu_matmul,
    ))
    load_s = time.perf_counter() - t0
    vocab = engine.model_config.vocab_size
    prompts, out_lens = make_workload(args.num_seqs, inp, out, vocab, args.seed)

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)

    # warm-up on other ids (the prefix cache cannot serve the timed prompts from it)
    warm, _ = make_workload(4, (16, 16), (4, 4), vocab, args.seed + 1)
    for w in warm:
        engine.add_request(w, params(4))
    while engine.has_unfinished():
        engine.step()
    engine.kv.reset_prefix_cache()

    ids = [engine.add_request(p, params(n)) for p, n in zip(prompts, out_lens, strict=True)]
    done: dict[str, list[int]] = {}
    with progress_bar(args.progress, sum(out_lens), "kvserve") as bar, Timer() as timer:
        while engine.has_unfinished():
            for out in engine.step():
                bar.update(len(out.delta_token_ids))
                if out.finished:
                    done[out.request_id] = out.token_ids
    tokens = [done[i] for i in ids]
    res = figures(timer, prompts, tokens)
    res["load_s"] = load_s
    res["preemptions"] = engine.scheduler.num_preemptions
    if engine.runner.device.type == "cuda":
        from kvserve.bench.roofline import copy_bandwidth_gbps, roofline_for

        # decode at the largest batch the workload allows, at its mean context
        batch = min(args.max_num_seqs, len(prompts))
        ctx = sum(map(len, prompts)) / len(prompts) + sum(out_lens) / len(out_lens) / 2
        res["copy_gbps"] = copy_bandwidth_gbps(engine.runner.device)
        res["roofline_out_tokens_per_s"] = roofline_for(engine.runner, res["copy_gbps"], batch, ctx)
        res["roofline_fraction"] = res["output_tokens_per_s"] / res["roofline_out_tokens_per_s"]
    return res, prompts, out_lens, tokens, engine.model_config, engine.runner


def cmd_throughput(args: argparse.Namespace) -> int:
    import torch

    try:
        inp, out = parse_range(args.input_len), parse_range(args.output_len)
        if args.num_seqs < 1:
            raise ValueError("--num-seqs must be >= 1")
    except ValueError as e:
        print(f"kvserve bench throughput: {e}", file=sys.stderr)
        return 2
    threads = args.threads or available_cores()
    torch.set_num_threads(threads)
    if args.json_schema_share:
        if not 0 < args.json_schema_share <= 1:
            print("kvserve bench throughput: --json-schema-share must be in (0, 1]", file=sys.stderr)
            return 2
        from kvserve.bench import structured_steps

        res = structured_steps.run(args, threads, inp, out)
        print(f"machine: {machine_info(threads)['cpu']}, {threads} threads")
        structured_steps.print_report(res)
        write_json(args.json, {"benchmark": "throughput_json_schema",
                               "machine": machine_info(threads), **res})
        return 0
    kv, prompts, out_lens, kv_tokens, cfg, runner = run_kvserve(args, threads, inp, out)
    gflop = workload_gflop(cfg, prompts, out_lens)
    report: dict[str, Any] = {
        "benchmark": "throughput",
        "workload": {"num_seqs": args.num_seqs, "input_len": args.input_len,
                     "output_len": args.output_len, "seed": args.seed,
                     "model": args.model or "default", "gflop": gflop,
                     "cpu_matmul": args.cpu_matmul},
        "machine": machine_info(threads),
        "kvserve": kv,
        "baselines": {},
    }
    kv["gflops"] = gflop / kv["elapsed_s"]
    if args.baseline == "hf":
        from kvserve.bench.hf import load_hf_model, run_hf_continuous

        try:
            model = load_hf_model(args.model, str(runner.device), runner.dtype)
            res, tokens = run_hf_continuous(model, prompts, out_lens, progress=args.progress)
            res["gflops"] = gflop / res["elapsed_s"]
            res["speedup_kvserve"] = kv["output_tokens_per_s"] / res["output_tokens_per_s"]
            res["kvserve_match"] = identical(kv_tokens, tokens)
        except Exception as e:  # report why the baseline could not run, keep kvserve's figures
            res = {"error": f"{type(e).__name__}: {e}"}
        report["baselines"]["hf_continuous"] = res
    print_report(report)
    write_json(args.json, report)
    return 0


def print_report(r: dict[str, Any]) -> None:
    w, m = r["workload"], r["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, {m['torch_threads']} threads")
    print(f"workload: {w['num_seqs']} requests, input {w['input_len']} random tokens, output "
          f"{w['output_len']} tokens (greedy, EOS ignored), {w['gflop']:.0f} GFLOP in all")
    print(f"{'engine':<16}{'requests':>9}{'in tok':>8}{'out tok':>8}{'elapsed s':>11}"
          f"{'out tok/s':>11}{'total tok/s':>13}{'GFLOP/s':>9}{'x 68':>6}{'kvserve x':>11}{'same':>8}")
    for name, res in [("kvserve", r["kvserve"])] + list(r["baselines"].items()):
        if "error" in res:
            print(f"{name:<16}  not run: {res['error']}")
            continue
        ratio = f"{res['speedup_kvserve']:.2f}" if "speedup_kvserve" in res else ""
        match = res.get("kvserve_match")
        same = f"{match['identical']}/{match['of']}" if match else ""
        print(f"{name:<16}{res['requests']:>9}{res['input_tokens']:>8}{res['output_tokens']:>8}"
              f"{res['elapsed_s']:>11.2f}{res['output_tokens_per_s']:>11.1f}"
              f"{res['total_tokens_per_s']:>13.1f}{res['gflops']:>9.1f}"
              f"{res['gflops'] / ISSUE_GFLOPS:>6.2f}{ratio:>11}{same:>8}")
    kv = r["kvserve"]
    if "roofline_out_tokens_per_s" in kv:
        print(f"decode roofline (weights + attended KV per step at {kv['copy_gbps']:.0f} GB/s copy "
              f"bandwidth): {kv['roofline_out_tokens_per_s']:.0f} out tok/s; kvserve reaches "
              f"{kv['roofline_fraction']:.1%} of it")
    if r["kvserve"].get("cpu_per_wall", m["torch_threads"]) < 0.8 * m["torch_threads"]:
        print("warning: kvserve got less CPU than its threads (other load?); re-run on a quiet machine")
