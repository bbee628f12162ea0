"""`kvserve bench serve --compare-migration`: the same skewed load with stream migration on
and off, in alternating passes against one self-started multi-worker service.

`--skew S` gives a share S of the requests one session, which the service pins to one worker
however loaded; with a small KV pool that worker parks streams, and migration moves them to
the other workers. Every pass sends the same requests; only the router's migration setting
differs. A fixed order (all "on" passes, then all "off") would credit one configuration
with the machine's drift and the prefix cache the earlier passes filled, so an untimed
priming pass fills the cache first and the timed passes alternate in mirrored rounds
(on, off, off, on, ...): each configuration runs as often early as late.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from kvserve.bench.serve_dataset import BenchRequest

HOT_SESSION = "kvserve-bench-hot"
ON, OFF = "migration on", "migration off"
MODES = (ON, OFF)


def apply_skew(requests: list[BenchRequest], share: float, seed: int) -> list[BenchRequest]:
    """Give `share` of the requests (a seeded random pick) the one hot session."""
    if share <= 0 or not requests:
        return requests
    rng = np.random.default_rng(seed + 104729)
    hot = set(rng.choice(len(requests), size=round(share * len(requests)), replace=False).tolist())
    for i in hot:
        requests[i].session_id = HOT_SESSION
    return requests


def pass_order(rounds: int, modes: tuple[str, str] = MODES) -> list[str]:
    """Mirrored rounds: on, off, off, on, on, off, ... (two passes per round)."""
    return [m for r in range(rounds) for m in (modes if r % 2 == 0 else modes[::-1])]


def moved_streams(router: Any) -> int:
    import ray

    info = ray.get(router.server_info.remote())
    return int(sum(w["stats"].get("migration_streams_in", 0) for w in info["workers"]))


def one_pass(mode: str, moved: int, results: list[Any], duration: float,
             output_throughput: float) -> dict[str, Any]:
    """A timed pass: its configuration, streams moved, results and figures."""
    ttft = [r.ttft * 1000 for r in results if r.success] or [0.0]
    return {"mode": mode, "moved": moved, "results": results, "duration": duration,
            "output_throughput": output_throughput,
            "workers_used": sorted({r.worker for r in results if r.worker}),
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99))}


def summarize(
    passes: list[dict[str, Any]], modes: tuple[str, str] = MODES
) -> dict[str, dict[str, float]]:
    """Per configuration: output tok/s over its passes (median, mean) and TTFT p50/p99 over
    all its requests."""
    out: dict[str, dict[str, float]] = {}
    for mode in modes:
        mine = [p for p in passes if p["mode"] == mode]
        if not mine:
            continue
        tput = [p["output_throughput"] for p in mine]
        ttft = [r.ttft * 1000.0 for p in mine for r in p["results"] if r.success]
        out[mode] = {
            "passes": len(mine),
            "output_throughput_median": float(np.median(tput)),
            "output_throughput_mean": float(np.mean(tput)),
            "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else 0.0,
            "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft else 0.0,
            "streams_moved": sum(p["moved"] for p in mine),
        }
    return out


def format_summary(passes: list[dict[str, Any]], summary: dict[str, dict[str, float]]) -> str:
    lines = ["bench serve: pass order: " + ", ".join(
                 f"{i + 1}. {p['mode']}" for i, p in enumerate(passes)),
             f"{'pass':<6}{'configuration':<16}{'moved':>7}{'tok/s':>9}{'TTFT p50':>11}"
             f"{'TTFT p99':>11}{'duration':>10}"]
    for i, p in enumerate(passes):
        lines.append(f"{i + 1:<6}{p['mode']:<16}{p['moved']:>7}{p['output_throughput']:>9.1f}"
                     f"{p['ttft_p50_ms'] / 1000:>10.1f}s{p['ttft_p99_ms'] / 1000:>10.1f}s"
                     f"{p['duration']:>9.1f}s")
    lines.append(f"{'configuration':<16}{'passes':>7}{'tok/s median':>14}{'tok/s mean':>12}"
                 f"{'TTFT p50':>11}{'TTFT p99':>11}{'moved':>7}")
    for mode, s in summary.items():
        lines.append(f"{mode:<16}{s['passes']:>7}{s['output_throughput_median']:>14.1f}"
                     f"{s['output_throughput_mean']:>12.1f}{s['ttft_p50_ms'] / 1000:>10.1f}s"
                     f"{s['ttft_p99_ms'] / 1000:>10.1f}s{s['streams_moved']:>7}")
    return "\n".join(lines)


def compare_migration(
    a: argparse.Namespace, make_client: Callable[[], Any], requests: list[BenchRequest],
    warmups: list[BenchRequest], bench_one: Callable, record: Callable,
) -> dict[str, Any]:
    """A priming pass, then `a.migration_rounds` mirrored rounds of on/off passes; records
    each pass and returns the passes (without per-request results) and the summary."""
    import ray

    from kvserve.router.router import NAMESPACE, ROUTER_NAME

    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    ray.get(router.set_migration.remote(False))
    _, prime_s, _ = asyncio.run(bench_one(make_client(), requests, warmups, a))
    print(f"bench serve: priming pass (untimed, migration off): {prime_s:.1f} s", flush=True)
    passes: list[dict[str, Any]] = []
    for i, mode in enumerate(pass_order(a.migration_rounds)):
        ray.get(router.set_migration.remote(mode == ON))
        before = moved_streams(router)
        results, duration, meter = asyncio.run(bench_one(make_client(), requests, [], a))
        m = record(f"{a.target}, pass {i + 1}: {mode}", results, duration, meter)
        passes.append(one_pass(mode, moved_streams(router) - before, results, duration,
                               m["output_throughput"]))
        print(f"bench serve: pass {i + 1} ({mode}): {passes[-1]['moved']} streams moved",
              flush=True)
    summary = summarize(passes)
    print(format_summary(passes, summary), flush=True)
    return {"order": [p["mode"] for p in passes], "priming_pass_s": prime_s,
            "passes": [{k: v for k, v in p.items() if k != "results"} for p in passes],
            "summary": summary}

