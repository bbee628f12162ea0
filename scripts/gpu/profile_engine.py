"""Where the engine's time goes: a workload run under torch.profiler and host timers.

Workloads:
  decode    B streams of 256-token prompts decoding together (after every prefill): ms per step
  generate  LLM.generate of N prompts (the throughput bench's shape)
  pressure  LLM.generate with the device KV pool at half the need (the pressure bench),
            with the host tier (--host-gib) or recompute (--host-gib 0)

It runs the workload twice. The first run prints steps by kind (decode or with prompt tokens;
graph replay or eager) and host time per engine phase (scheduling, KV plan and commit, step
inputs, launch, waits for sampled ids, sampling, token appends with stop checks,
detokenization and outputs, evictions and host-tier copies). The second runs under
torch.profiler (it slows the host) and prints the device time of kernels, copies by
direction and host-side synchronisations (on the CPU: the top operators). Runs on the CPU
too (a small model, small sizes), which is how it is tested.

Usage: python scripts/gpu/profile_engine.py MODEL [BATCH] [--workload decode|generate|pressure]
           [--num-prompts N] [--input-len L] [--output-len L] [--steps S] [--trace FILE.json]
           [--async-scheduling on|off] [--host-gib G] [--kv-cache-tokens T] [--no-profiler]
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from typing import Any

import torch

from kvserve.kvcache.manager import KVCacheManager
from kvserve.llm import LLM
from kvserve.sampling import SamplingParams
from kvserve.workers.engine.sampler import SampledBatch
from kvserve.workers.engine.scheduler import Scheduler
from kvserve.workers.model import runner as runner_mod


class Phases:
    """Wall seconds and calls per phase, from wrappers around the engine's methods (outer
    phases include the inner ones they call)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.steps: dict[str, int] = collections.defaultdict(int)
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
                self.calls[phase] += 1

        self.replace(owner, name, timed)

    def reset(self) -> None:
        """Count from here (a workload's timed part)."""
        self.seconds.clear()
        self.calls.clear()
        self.steps.clear()

    def replace(self, owner: Any, name: str, new: Any) -> None:
        had = name in vars(owner)
        self._undo.append((owner, name, vars(owner).get(name) if had else None, had))
        setattr(owner, name, new)

    def undo(self) -> None:
        for owner, name, old, had in reversed(self._undo):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._undo.clear()

    def report(self, wall: float) -> None:
        print(f"steps: {dict(self.steps)}")
        print(f"{'phase':<34} {'calls':>7} {'total ms':>10} {'us/call':>9} {'of wall':>8}")
        for phase, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            n = self.calls[phase]
            print(f"{phase:<34} {n:>7} {s * 1e3:>10.1f} {s / max(n, 1) * 1e6:>9.1f} {s / wall:>7.1%}")


def instrument(llm: LLM, ph: Phases) -> None:
    eng = llm.engine
    runner = eng.runner
    ph.wrap(Scheduler, "schedule", "scheduler.schedule (with reserve)")
    ph.wrap(Scheduler, "park", "scheduler.park (evictions, write-back)")
    ph.wrap(KVCacheManager, "reserve", "kv.reserve")
    ph.wrap(KVCacheManager, "commit", "kv.commit")
    ph.wrap(runner_mod, "build_step", "build_step (step inputs)")
    ph.wrap(runner, "_move_blocks", "host-tier copies (demote, restore)")
    ph.wrap(runner, "_forward", "forward launch (all of it on the CPU)")
    ph.wrap(SampledBatch, "result", "wait for sampled ids (sync)")
    ph.wrap(eng, "_sample", "sampler")
    ph.wrap(eng, "_append", "append tokens, stops, detok, outputs")
    graphs = runner.graphs
    build = runner_mod.build_step

    def counted(plan: Any, *a: Any) -> Any:
        step = build(plan, *a)
        kind = "decode" if len(step.input_ids) == len(step.query_lens) else "with prompt tokens"
        path = "eager"
        if graphs is not None and graphs.key_for(step) is not None:
            path = "graph"
        ph.steps[f"{kind}, {path}"] += 1
        return step

    ph.replace(runner_mod, "build_step", counted)


def profiler_report(prof: Any, cuda: bool) -> None:
    events = prof.key_averages()
    if not cuda:
        print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
        return
    kern = copies = 0.0
    by_copy: dict[str, float] = collections.defaultdict(float)
    syncs: dict[str, tuple[int, float]] = {}
    for e in events:
        dev = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        name = e.key
        if "Memcpy" in name or "Memset" in name:
            copies += dev
            by_copy[name] += dev
        elif dev > 0:
            kern += dev
        if "Synchronize" in name or name in ("aten::item", "aten::_local_scalar_dense"):
            syncs[name] = (e.count, e.cpu_time_total)
    print(f"device: kernels {kern / 1e3:.1f} ms, copies {copies / 1e3:.1f} ms")
    for k, v in sorted(by_copy.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<40} {v / 1e3:>9.2f} ms")
    for k, (n, cpu) in sorted(syncs.items(), key=lambda kv: -kv[1][1]):
        print(f"host sync {k:<36} {n:>6} calls {cpu / 1e3:>9.2f} ms")
    print(events.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=50))


def workload(args: argparse.Namespace, llm: LLM, ph: Phases | None = None) -> tuple[float, int]:
    """Run the workload; returns (wall seconds, generated tokens) of its timed part."""
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [torch.randint(100, min(40000, vocab), (length,), generator=g).tolist() for _ in range(n)]

    if args.workload == "decode":
        p = SamplingParams(max_tokens=10_000, min_tokens=10_000, temperature=0.0, ignore_eos=True)
        for ids in prompts(args.batch, args.input_len):
            eng.add_request(ids, p)
        while eng.scheduler.waiting or any(not s.output_ids for s in eng.scheduler.running):
            eng.step()
        for _ in range(3):
            eng.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if ph is not None:
            ph.reset()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        print(f"engine B={args.batch}: {wall / args.steps * 1e3:.3f} ms/step decode")
        for rid in list(eng.seqs):  # done: the next run starts from an idle engine
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
        return wall, args.steps * args.batch
    n = args.output_len
    p = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    ps = prompts(args.num_prompts, args.input_len)
    if ph is not None:
        ph.reset()
    t0 = time.perf_counter()
    outs = llm.generate(ps, p)
    wall = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    print(f"{args.workload}: {len(outs)} x {args.input_len} -> {n}: {wall:.2f} s, {toks / wall:,.0f} out tok/s")
    return wall, toks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("batch", nargs="?", type=int, default=64, help="decode: streams")
    ap.add_argument("--workload", choices=["decode", "generate", "pressure"], default="decode")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50, help="decode: steps profiled")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-tokens", type=int, default=None)
    ap.add_argument("--host-gib", type=float, default=None, help="pressure: host tier (0: recompute)")
    ap.add_argument("--async-scheduling", choices=["on", "off", "auto"], default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--trace", default=None, help="also write the profiled run's Chrome trace here")
    ap.add_argument("--no-profiler", action="store_true", help="the timed run only")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    need = (args.num_prompts if args.workload != "decode" else args.batch) * (
        args.input_len + (args.output_len if args.workload != "decode" else args.steps + 16))
    kv = args.kv_cache_tokens or (need // 2 if args.workload == "pressure" else need + 4096)
    cfg: dict[str, Any] = {"kv_cache_tokens": kv, "max_num_batched_tokens": 2048,
                           "max_num_seqs": args.batch if args.workload == "decode" else args.max_num_seqs,
                           "num_threads": args.threads,
                           "async_scheduling": {"on": True, "off": False, "auto": None}[args.async_scheduling]}
    if args.workload == "pressure":
        cfg.update(admission_lookahead_tokens=0, host_cache_gib=args.host_gib)
    else:
        cfg["host_cache_gib"] = 0
    llm = LLM(args.model, **cfg)
    eng = llm.engine
    print(f"device {eng.runner.device}, graphs {'on' if eng.runner.graphs is not None else 'off'}, "
          f"async scheduling {'on' if eng.async_scheduling else 'off'}, KV {kv} tokens")
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[100 + i] * 16 for i in range(4)], warm)  # first-call costs out of the figures
    ph = Phases()
    instrument(llm, ph)
    try:
        wall, toks = workload(args, llm, ph)
    finally:
        ph.undo()
    stats = eng.stats()
    print(f"wall {wall:.3f} s, {toks} tokens; evictions {stats['evictions']}, restores {stats['restores']}, "
          f"tokens restored {stats['tokens_restored_copy']}, recomputed {stats['tokens_recomputed']}")
    ph.report(wall)
    if args.no_profiler:
        return 0
    print("--- the same workload again, under torch.profiler")
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        workload(args, llm)
    profiler_report(prof, cuda)
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"trace: {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
