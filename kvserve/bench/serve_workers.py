"""`kvserve bench serve --compare-workers`: one worker against N workers of the same engine
settings, in mirrored passes against one self-started service.

Every worker of both configurations is the same engine: 1/N of --kv-cache-tokens, the same
GPU share (--gpus-per-worker, e.g. 0.5 for two workers on one GPU) or, on CPU, cores/N
threads. Between passes the service's router is resized in place (the workers it gains load
the model, those it loses are drained), so worker 0 serves every pass. Each pass sends its own prompts (same lengths, another seed): a pass
that repeated earlier prompts would find their prefixes cached on worker 0 and skip their
prefill. The passes alternate in mirrored rounds (1, N, N, 1, ...), as --compare-migration's.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

from kvserve.bench.serve_dataset import BenchRequest
from kvserve.bench.serve_migration import (
    format_summary,
    moved_streams,
    one_pass,
    pass_order,
    summarize,
)

SEED_STEP = 1009  # pass i's prompts come from seed + (i + 1) * SEED_STEP


def modes(n: int) -> tuple[str, str]:
    return "1 worker", f"{n} workers"


def compare_workers(
    a: argparse.Namespace, service: Any, make_client: Callable[[], Any],
    requests_for: Callable[[int], list[BenchRequest]], warmups: list[BenchRequest],
    bench_one: Callable, record: Callable,
) -> dict[str, Any]:
    """`a.rounds` mirrored rounds of a one-worker and an N-worker pass; records each pass and
    returns the passes (without per-request results), the summary and the throughput ratio."""
    one, many = modes(a.workers)
    router = service.router()
    passes: list[dict[str, Any]] = []
    for i, mode in enumerate(pass_order(a.rounds, (one, many))):
        service.resize(1 if mode == one else a.workers)
        before = moved_streams(router)
        results, duration, meter = asyncio.run(
            bench_one(make_client(), requests_for(i), warmups, a))
        m = record(f"{a.target}, pass {i + 1}: {mode}", results, duration, meter)
        passes.append(one_pass(mode, moved_streams(router) - before, results, duration,
                               m["output_throughput"]))
    summary = summarize(passes, (one, many))
    print(format_summary(passes, summary), flush=True)
    ratio = (summary[many]["output_throughput_median"]
             / max(summary[one]["output_throughput_median"], 1e-9))
    print(f"{many} / {one} output tok/s (medians): {ratio:.3f}x   TTFT p50: "
          f"{summary[one]['ttft_p50_ms']:.1f} ms ({one}), {summary[many]['ttft_p50_ms']:.1f} ms "
          f"({many})", flush=True)
    return {"order": [p["mode"] for p in passes],
            "passes": [{k: v for k, v in p.items() if k != "results"} for p in passes],
            "summary": summary, "output_throughput_ratio": ratio}
