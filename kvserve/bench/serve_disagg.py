"""`kvserve bench serve --prefill-workers P --decode-workers D`: disaggregated serving against
the same number of mixed workers, in one run against one self-started service.

The service starts with P prefill and D decode workers; between passes the router re-roles
the same workers (`set_roles`): P + D mixed workers, or P prefill and D decode. Every worker
is the same engine either way, so the passes differ only by where prompts run. Each pass
sends its own prompts (same lengths, another seed): a pass that repeated earlier prompts
would find them cached, and a decode worker that caches most of a prompt prefills it itself.
Passes alternate in mirrored rounds (disaggregated, mixed, mixed, disaggregated, ...).

Figures per configuration: TTFT and ITL p50/p99 over all its requests (ITL needs
`--stream-interval-ms 0` to be the engine's steps rather than the pacing interval), output
throughput; hand-offs and local prefills; the hand-off time by prompt length. `--handoff-sweep`
then sends prompts of the given lengths one at a time (every one handed off, then every one
prefilled where it decodes) for the hand-off time and bytes against the prompt length.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvserve.bench.serve_dataset import BenchRequest
from kvserve.bench.serve_migration import pass_order

DISAGG, MIXED = "disaggregated", "mixed"
SWEEP_REPEATS = 3  # requests per prompt length in --handoff-sweep


def roles(a: argparse.Namespace) -> list[str]:
    return ["prefill"] * a.prefill_workers + ["decode"] * a.decode_workers


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize(passes: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per configuration: TTFT and ITL p50/p99 (ms) over all its requests, output tok/s
    (median of its passes), hand-offs and local prefills."""
    out: dict[str, dict[str, float]] = {}
    for mode in (DISAGG, MIXED):
        mine = [p for p in passes if p["mode"] == mode]
        if not mine:
            continue
        ok = [r for p in mine for r in p["results"] if r.success]
        ttft = [r.ttft * 1e3 for r in ok]
        itl = [g * 1e3 for r in ok for g in r.itl]
        out[mode] = {
            "passes": len(mine),
            "requests": len(ok),
            "failed": sum(1 for p in mine for r in p["results"] if not r.success),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99),
            "output_throughput_median": float(np.median([p["output_throughput"] for p in mine])),
            "handoffs": sum(p["handoffs"] for p in mine),
            "local_prefills": sum(p["local"] for p in mine),
        }
    return out


def by_length(entries: list[dict[str, Any]], edges: tuple[int, ...] = (128, 256, 512, 1024,
                                                                         2048, 4096)) -> list[dict]:
    """Moved hand-offs binned by prompt length: count, time p50/p99 (ms), bytes p50."""
    rows = []
    lo = 0
    for hi in (*edges, 1 << 30):
        mine = [e for e in entries if e["outcome"] == "moved" and lo <= e["prompt_tokens"] < hi]
        if mine:
            s = [e["seconds"] * 1e3 for e in mine]
            rows.append({"prompt_tokens": f"{lo}-{hi - 1}" if hi < 1 << 30 else f">={lo}",
                         "handoffs": len(mine), "ms_p50": _pct(s, 50), "ms_p99": _pct(s, 99),
                         "bytes_p50": _pct([e["bytes"] for e in mine], 50)})
        lo = hi
    return rows


def format_summary(summary: dict[str, dict[str, float]], lengths: list[dict]) -> str:
    lines = [f"{'configuration':<15}{'passes':>7}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
             f"{'ITL p99':>9}{'tok/s':>8}{'hand-offs':>11}{'local':>7}{'failed':>8}"]
    for mode, s in summary.items():
        lines.append(f"{mode:<15}{s['passes']:>7}{s['ttft_p50_ms']:>8.0f}ms"
                     f"{s['ttft_p99_ms']:>8.0f}ms{s['itl_p50_ms']:>7.0f}ms{s['itl_p99_ms']:>7.0f}ms"
                     f"{s['output_throughput_median']:>8.1f}{s['handoffs']:>11}"
                     f"{s['local_prefills']:>7}{s['failed']:>8}")
    if lengths:
        lines.append(f"{'prompt tokens':<15}{'hand-offs':>10}{'time p50':>10}{'time p99':>10}"
                     f"{'KV bytes p50':>14}")
        for r in lengths:
            lines.append(f"{r['prompt_tokens']:<15}{r['handoffs']:>10}{r['ms_p50']:>8.1f}ms"
                         f"{r['ms_p99']:>8.1f}ms{r['bytes_p50'] / 2**20:>11.2f}MiB")
    return "\n".join(lines)


def _counts(router: Any) -> tuple[int, int]:
    import ray

    d = ray.get(router.server_info.remote())["disagg"]
    return sum(d["handoffs"].values()), sum(d["local_prefills"].values())


def compare_disagg(
    a: argparse.Namespace, service: Any, make_client: Callable[[], Any],
    requests_for: Callable[[int], list[BenchRequest]], warmups: list[BenchRequest],
    bench_one: Callable, record: Callable,
    sweep: Callable[[int, int], list[BenchRequest]] | None,
) -> dict[str, Any]:
    """`a.disagg_rounds` mirrored rounds of a disaggregated and a mixed pass, then the
    hand-off sweep; records each pass and returns the passes (without per-request results),
    the summary, the hand-off time by prompt length and the sweep."""
    import ray

    router = service.router()
    split, mixed = roles(a), ["mixed"] * (a.prefill_workers + a.decode_workers)
    passes: list[dict[str, Any]] = []
    handoffs: list[dict[str, Any]] = []
    for i, mode in enumerate(pass_order(a.disagg_rounds, (DISAGG, MIXED))):
        ray.get(router.set_roles.remote(split if mode == DISAGG else mixed))
        h0, l0 = _counts(router)
        logged = len(ray.get(router.handoff_log.remote()))
        results, duration, meter = asyncio.run(
            bench_one(make_client(), requests_for(i), warmups, a))
        m = record(f"{a.target}, pass {i + 1}: {mode}", results, duration, meter)
        time.sleep(0.5)  # the router logs a hand-off as it ends, just after its client's token
        h1, l1 = _counts(router)
        handoffs += ray.get(router.handoff_log.remote())[logged:]
        passes.append({"mode": mode, "results": results, "duration": duration,
                       "output_throughput": m["output_throughput"], "handoffs": h1 - h0,
                       "local": l1 - l0})
    summary = summarize(passes)
    lengths = by_length(handoffs)
    print(format_summary(summary, lengths), flush=True)
    out: dict[str, Any] = {
        "order": [p["mode"] for p in passes],
        "passes": [{k: v for k, v in p.items() if k != "results"} for p in passes],
        "summary": summary, "handoff_by_prompt_length": lengths,
        "handoff_outcomes": {o: sum(1 for e in handoffs if e["outcome"] == o)
                             for o in sorted({e["outcome"] for e in handoffs})},
    }
    if sweep is not None:
        out["sweep"] = handoff_sweep(a, router, make_client, sweep, split, mixed)
    ray.get(router.set_roles.remote(split))
    return out


def handoff_sweep(a: argparse.Namespace, router: Any, make_client: Callable[[], Any],
                  prompts: Callable[[int, int], list[BenchRequest]], split: list[str],
                  mixed: list[str]) -> list[dict[str, Any]]:
    """Prompts of each --handoff-sweep length, one at a time on an otherwise idle service:
    handed off (every prompt: min_prompt_tokens 0), then prefilled where they decode (mixed
    workers; other prompts of the same length). Per length: the hand-off's time and bytes,
    and the time to first token both ways (the prefill itself, which a decode worker's
    streams wait for when it prefills locally)."""
    import ray

    old = ray.get(router.set_disagg.remote(min_prompt_tokens=0))
    rows = []
    try:
        for n in a.handoff_sweep:
            row: dict[str, Any] = {"prompt_tokens": n}
            for k, (mode, r) in enumerate(((DISAGG, split), (MIXED, mixed))):
                ray.get(router.set_roles.remote(r))
                logged = len(ray.get(router.handoff_log.remote()))

                async def one_by_one(reqs: list[BenchRequest]) -> list[Any]:
                    c = make_client()
                    await c.start()
                    try:
                        return [await c.send(q) for q in reqs]
                    finally:
                        await c.close()

                # other prompts each way: the second must not find the first's in a prefix cache
                results = asyncio.run(one_by_one(prompts(n, k)))
                time.sleep(0.5)
                ttft = [x.ttft * 1e3 for x in results if x.success]
                row[f"ttft_{mode}_ms"] = _pct(ttft, 50)
                if mode == DISAGG:
                    moved = [e for e in ray.get(router.handoff_log.remote())[logged:]
                             if e["outcome"] == "moved"]
                    row["handoffs"] = len(moved)
                    row["handoff_ms"] = _pct([e["seconds"] * 1e3 for e in moved], 50)
                    row["handoff_bytes"] = _pct([e["bytes"] for e in moved], 50)
            rows.append(row)
            print(f"bench serve: hand-off sweep: {n} prompt tokens: hand-off "
                  f"{row['handoff_ms']:.1f} ms, {row['handoff_bytes'] / 2**20:.2f} MiB; TTFT "
                  f"{row['ttft_disaggregated_ms']:.0f} ms handed off, "
                  f"{row['ttft_mixed_ms']:.0f} ms prefilled where it decodes", flush=True)
    finally:
        ray.get(router.set_disagg.remote(**old))
    return rows
