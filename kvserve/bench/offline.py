"""`kvserve bench offline`: LLM.generate on random-token prompts, optionally vs transformers.

Every request generates exactly --output-len tokens (greedy, EOS ignored); the baseline
runs the same prompts through transformers (kvserve/bench/hf.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvserve.bench.common import (
    Timer,
    figures,
    identical,
    machine_info,
    progress_bar,
    random_prompts,
    write_json,
)
from kvserve.hardware import available_cores


def add_parser(sub: argparse._SubParsersAction) -> None:
    o = sub.add_parser(
        "offline",
        help="throughput of LLM.generate on random-token prompts (optionally vs transformers)",
    )
    o.add_argument("--num-prompts", type=int, default=32)
    o.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    o.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    o.add_argument("--baseline", choices=["hf"], default=None,
                   help="also run the prompts through transformers (same process, same threads)")
    o.add_argument("--generate-batch", action=argparse.BooleanOptionalAction, default=True,
                   help="with --baseline hf, also run transformers' continuous batching, which "
                        "sizes its paged cache from free RAM (default: on)")
    o.add_argument("--model", default=None,
                   help="GGUF file or HF directory of a supported family (default: SmolLM2-135M)")
    o.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    o.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    o.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run a small untimed generate first (default: on)")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bars on stderr (default: on)")
    o.add_argument("--json", default=None, metavar="FILE", help="write all figures here")
    o.set_defaults(func=cmd_offline)


# ---- kvserve -------------------------------------------------------------------------------
@contextmanager
def _metered_steps(engine: Any, on_tokens: Callable[[int], None]) -> Iterator[dict[str, float]]:
    """Wrap `engine.step` for one run: feed generated-token counts to a progress bar and note
    when every request of the run has its first token (the end of the prefill phase)."""
    inner = engine.step
    marks: dict[str, float] = {}

    def step(finished_only: bool = False) -> list[Any]:
        outs = inner()  # every output, for the bar; LLM.generate wants the finished ones
        for out in outs:
            on_tokens(len(out.delta_token_ids))
        if "all_first_tokens" not in marks and not _prefill_left(engine):
            marks["all_first_tokens"] = time.perf_counter()
        return [o for o in outs if o.finished] if finished_only else outs

    engine.step = step  # an instance attribute shadows the method until deleted
    try:
        yield marks
    finally:
        del engine.step


def _prefill_left(engine: Any) -> bool:
    """Whether some request still waits for its first token."""
    return bool(engine.scheduler.waiting) or any(not s.output_ids for s in engine.scheduler.running)


def run_kvserve(
    args: argparse.Namespace, threads: int
) -> tuple[dict[str, Any], list[list[int]], list[list[int]]]:
    """Time LLM.generate on the random prompts; returns (figures, prompts, output ids)."""
    from kvserve.llm import LLM
    from kvserve.sampling import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, num_threads=threads)
    load_s = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    # min_tokens = max_tokens bans EOS for the whole run, the same rule as transformers'
    # min_new_tokens, so both sides pick the same greedy token even where EOS is the argmax.
    params = SamplingParams(
        max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0, ignore_eos=True
    )
    if args.warmup:
        # other ids than the timed prompts (seed + 1), so the prefix cache cannot serve them
        warm = random_prompts(min(4, args.num_prompts), args.input_len, vocab, args.seed + 1)
        llm.generate(warm, params.model_copy(update={"max_tokens": 4, "min_tokens": 4}))
    total = args.num_prompts * args.output_len
    with progress_bar(args.progress, total, "kvserve") as bar:
        with _metered_steps(llm.engine, bar.update) as marks, Timer() as timer:
            outs = llm.generate(prompts, params)
    tokens = [o.token_ids for o in outs]
    res = figures(timer, prompts, tokens)
    res["load_s"] = load_s
    res["cached_prompt_tokens"] = sum(o.usage.cached_tokens for o in outs)
    if "all_first_tokens" in marks:
        res["prefill_s"] = marks["all_first_tokens"] - timer.t0
        res["decode_s"] = timer.elapsed - res["prefill_s"]
    return res, prompts, tokens


# ---- the command ---------------------------------------------------------------------------
def cmd_offline(args: argparse.Namespace) -> int:
    import torch

    for name in ("num_prompts", "input_len", "output_len", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            print(f"kvserve bench: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    threads = args.threads or available_cores()
    torch.set_num_threads(threads)
    kv, prompts, kv_tokens = run_kvserve(args, threads)
    report: dict[str, Any] = {
        "benchmark": "offline",
        "workload": {
            "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "seed": args.seed, "model": args.model or "default",
            "greedy": True, "warmup": args.warmup,
        },
        "machine": machine_info(threads),
        "kvserve": kv,
        "baselines": {},
    }
    if args.baseline == "hf":
        from kvserve.bench.hf import run_hf_baselines

        for name, res, tokens in run_hf_baselines(args, prompts):
            if tokens is not None:
                res["speedup_kvserve"] = kv["output_tokens_per_s"] / res["output_tokens_per_s"]
                res["kvserve_match"] = identical(kv_tokens, tokens)
            report["baselines"][name] = res
    print_report(report)
    write_json(args.json, report)
    return 0


def print_report(r: dict[str, Any]) -> None:
    w, m, kv = r["workload"], r["machine"], r["kvserve"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; "
          f"torch {m['torch']}, {m['torch_threads']} threads")
    print(f"workload: {w['num_prompts']} prompts x {w['input_len']} random tokens -> "
          f"{w['output_len']} tokens each, greedy, EOS ignored")
    rows = [("kvserve", kv)] + list(r["baselines"].items())
    print(f"{'engine':<20}{'requests':>9}{'in tok':>8}{'out tok':>8}{'elapsed s':>11}"
          f"{'out tok/s':>11}{'total tok/s':>13}{'kvserve x':>11}{'same':>8}{'cpu/wall':>10}")
    for name, res in rows:
        if "error" in res:
            print(f"{name:<20}  not run: {res['error']}")
            continue
        ratio = f"{res['speedup_kvserve']:.2f}" if "speedup_kvserve" in res else ""
        match = res.get("kvserve_match")
        same = f"{match['identical']}/{match['of']}" if match else ""
        util = f"{res['cpu_per_wall']:.2f}" if "cpu_per_wall" in res else "-"
        print(f"{name:<20}{res['requests']:>9}{res['input_tokens']:>8}{res['output_tokens']:>8}"
              f"{res['elapsed_s']:>11.2f}{res['output_tokens_per_s']:>11.1f}"
              f"{res['total_tokens_per_s']:>13.1f}{ratio:>11}{same:>8}{util:>10}")
    for name, res in rows:
        if "prefill_s" in res:
            print(f"{name}: prefill (all first tokens) {res['prefill_s']:.2f} s, "
                  f"decode {res['decode_s']:.2f} s")
        if "call_s" in res:
            print(f"{name}: whole call {res['call_s']:.2f} s with its per-call cache setup "
                  f"and warm-up (cpu/wall {res['call_cpu_per_wall']:.2f})")
    busy = [n for n, res in rows if res.get("cpu_per_wall", m["torch_threads"]) < 0.8 * m["torch_threads"]]
    if busy:
        print(f"warning: {', '.join(busy)} got less CPU than its {m['torch_threads']} threads "
              "(cpu/wall); other load on the machine? re-run on a quiet machine")
    if kv.get("cached_prompt_tokens"):
        print(f"note: kvserve served {kv['cached_prompt_tokens']} prompt tokens from its prefix cache")
