"""`kvserve bench ...`: benchmarks that print figures and can write them as JSON.

`kvserve bench offline` times `LLM.generate` on a batch of random-token prompts where
every request generates exactly --output-len tokens (greedy, EOS ignored), optionally
against transformers on the same prompts (kvserve/bench_hf.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvserve.hardware import available_cores

# Prompt ids stay this far from both ends of the vocabulary: special and control tokens sit
# at the low end in most vocabularies (SmolLM2: 0..16) and added tokens at the high end.
VOCAB_MARGIN = 100


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    b.set_defaults(func=lambda a: b.print_help() or 0)
    bsub = b.add_subparsers(dest="bench_command")
    o = bsub.add_parser(
        "offline",
        help="throughput of LLM.generate on random-token prompts (optionally vs transformers)",
    )
    o.add_argument("--num-prompts", type=int, default=32)
    o.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    o.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    o.add_argument("--baseline", choices=["hf"], default=None,
                   help="also run the prompts through transformers (same process, same threads)")
    o.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    o.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    o.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    o.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run a small untimed generate first (default: on)")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bars on stderr (default: on)")
    o.add_argument("--json", default=None, metavar="FILE", help="write all figures here")
    o.set_defaults(func=cmd_offline)
    from kvserve import bench_batched

    bench_batched.add_parser(bsub)
    from kvserve import bench_attention

    bench_attention.add_parser(bsub)
    from kvserve import bench_serve

    bench_serve.add_parser(bsub)
    from kvserve import bench_throughput

    bench_throughput.add_parser(bsub)
    from kvserve import bench_multiturn, bench_pressure

    bench_pressure.add_parser(bsub)
    bench_multiturn.add_parser(bsub)


# ---- workload and machine ------------------------------------------------------------------
def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of exactly `length` ids drawn uniformly, away from special tokens."""
    import torch

    lo = min(VOCAB_MARGIN, vocab_size // 4)
    hi = max(lo + 1, vocab_size - lo)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (num, length), generator=g).tolist()


def machine_info(threads: int) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    ram_gib = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
        ram_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass  # not Linux: keep what platform knows
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": available_cores(),
        "ram_gib": ram_gib,
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


@dataclass
class Timer:
    """Wall and process CPU time of one timed section."""

    t0: float = 0.0
    cpu0: float = 0.0
    elapsed: float = 0.0
    cpu: float = 0.0

    def __enter__(self) -> Timer:
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.cpu0


def figures(
    timer: Timer, prompts: list[list[int]], outputs: list[list[int]], elapsed: float | None = None
) -> dict[str, Any]:
    """The throughput figures every run reports, from what it actually generated; `elapsed`
    replaces the timer's wall time where the run's own timestamps are more exact."""
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o) for o in outputs)
    wall = timer.elapsed if elapsed is None else elapsed
    return {
        "requests": len(prompts),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "elapsed_s": wall,
        "output_tokens_per_s": n_out / wall,
        "total_tokens_per_s": (n_in + n_out) / wall,
        # CPU seconds per wall second: well below the thread count means the run did not get
        # its cores (other load on the machine), and its figures are not representative
        "cpu_per_wall": timer.cpu / timer.elapsed,
    }


def identical(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many sequences agree exactly, and the mean length of the agreeing prefixes."""
    pairs = list(zip(a, b, strict=True))
    # zip stops at the shorter sequence: a length difference is a mismatch past the prefix
    prefix = [
        next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))
        for x, y in pairs
    ]
    return {
        "identical": sum(x == y for x, y in pairs),
        "of": len(pairs),
        "mean_common_prefix": sum(prefix) / max(1, len(prefix)),
    }


def write_json(path: str | None, report: dict[str, Any]) -> None:
    """Write a bench's figures (no-op without a path)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


def progress_bar(enabled: bool, total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, disable=not enabled,
                leave=False, dynamic_ncols=True)


# ---- kvserve -------------------------------------------------------------------------------
@contextmanager
def _metered_steps(engine: Any, on_tokens: Callable[[int], None]) -> Iterator[dict[str, float]]:
    """Wrap `engine.step` for one run: feed generated-token counts to a progress bar and note
    when every request of the run has its first token (the end of the prefill phase)."""
    inner = engine.step
    marks: dict[str, float] = {}

    def step() -> list[Any]:
        outs = inner()
        for out in outs:
            on_tokens(len(out.delta_token_ids))
        if "all_first_tokens" not in marks and not _prefill_left(engine):
            marks["all_first_tokens"] = time.perf_counter()
        return outs

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
        from kvserve.bench_hf import run_hf_baselines

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
