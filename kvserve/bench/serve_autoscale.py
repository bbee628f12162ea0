"""`kvserve bench serve --ramp ... --compare-autoscaling`: a load that ramps (low, burst, low)
against fixed pools of the minimum and the maximum size and against the autoscaled pool, in
one run, on one self-started service.

`--ramp 20:0.5,40:3,40:0.5` sends Poisson (gamma with --burstiness) arrivals at each
segment's rate for its seconds. The same requests go through three passes; between them the
router's autoscaling bounds are changed at run time (`set_autoscaling`): min = max = the
minimum (a fixed small pool), then min..max (the policy decides, from the minimum), then
min = max = the maximum (a fixed large pool, its workers loaded before the pass starts).
During each pass a sampler reads the router every 0.5 s: the workers that hold resources
(serving, starting, draining), integrated to worker-seconds (the cost), and the parked
streams, integrated to stream-seconds parked. The autoscaled pass reports its decisions and,
per worker it started, the time from the load first wanting it to its serving (pressure to
serving) and its cold start (decision to serving; the model's load within it).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvserve.bench.serve_dataset import BenchRequest

SAMPLE_S = 0.5
SETTLE_S = 600.0  # the pool reaching a pass's size (workers load the model)


def parse_ramp(spec: str) -> list[tuple[float, float]]:
    """'20:0.5,40:3' -> [(20.0, 0.5), (40.0, 3.0)]: seconds and requests/s per segment."""
    out = []
    for part in spec.split(","):
        try:
            secs, rate = (float(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--ramp takes SECONDS:RATE[,SECONDS:RATE...], got {spec!r}") \
                from None
        if not (secs > 0 and rate >= 0 and math.isfinite(secs) and math.isfinite(rate)):
            raise ValueError(f"--ramp: each segment needs seconds > 0 and a rate >= 0, got "
                             f"{part!r}")
        out.append((secs, rate))
    if not out or not any(rate for _, rate in out):
        raise ValueError(f"--ramp sends no request: {spec!r}")
    return out


def ramp_offsets(segments: list[tuple[float, float]], burstiness: float,
                 seed: int) -> list[float]:
    """Send times: in each segment, gamma gaps with mean 1/rate (shape `burstiness`), the
    arrivals that fall within it."""
    rng = np.random.default_rng(seed)
    out: list[float] = []
    start = 0.0
    for secs, rate in segments:
        t = start
        while rate > 0:
            t += float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
            if t >= start + secs:
                break
            out.append(t)
        start += secs
    return out


class PoolSampler:
    """The router's pool, read every SAMPLE_S in a thread while a pass runs."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PoolSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            try:
                info = ray.get(self.router.server_info.remote(), timeout=30)
            except Exception:  # (a slow answer: the next sample)
                continue
            a = info["autoscaling"]
            self.samples.append({
                "t": time.monotonic(),
                "workers": a["serving_workers"] + a["starting_workers"] + a["draining_workers"],
                "serving": a["serving_workers"],
                "parked": sum(w["parked"] for w in info["workers"] if w["alive"])})
            self._stop.wait(SAMPLE_S)

    def figures(self) -> dict[str, float]:
        s = self.samples
        if len(s) < 2:
            return {"worker_seconds": 0.0, "parked_stream_seconds": 0.0, "max_workers": 0,
                    "mean_workers": 0.0}
        dt = np.diff([x["t"] for x in s])
        workers = np.array([x["workers"] for x in s[:-1]], dtype=float)
        parked = np.array([x["parked"] for x in s[:-1]], dtype=float)
        span = float(dt.sum())
        return {"worker_seconds": float((workers * dt).sum()),
                "parked_stream_seconds": float((parked * dt).sum()),
                "max_workers": int(max(x["workers"] for x in s)),
                "mean_workers": float((workers * dt).sum() / span) if span else 0.0}


def _settle(router: Any, lo: int, hi: int, size: int | None, delays: dict[str, float]) -> None:
    """Bounds lo..hi; with `size`, wait until exactly that many workers serve and none
    starts or drains."""
    import ray

    ray.get(router.set_autoscaling.remote(min_workers=lo, max_workers=hi, **delays))
    if size is None:
        return
    deadline = time.monotonic() + SETTLE_S
    while True:
        a = ray.get(router.server_info.remote())["autoscaling"]
        if (a["serving_workers"], a["starting_workers"], a["draining_workers"]) == (size, 0, 0):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pool did not settle at {size} workers: {a}")
        time.sleep(0.5)


def compare_autoscaling(
    a: argparse.Namespace, service: Any, make_client: Callable[[], Any],
    requests: list[BenchRequest], offsets: list[float], warmups: list[BenchRequest],
    run_pass: Callable, record: Callable,
) -> dict[str, Any]:
    """The three passes; records each and returns their figures."""
    import ray

    router = service.router()
    lo, hi = a.min_workers, a.max_workers
    delays = {"upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s}
    plan = ((f"fixed {lo}", lo, lo, lo), ("autoscaled", lo, hi, None),
            (f"fixed {hi}", hi, hi, hi))
    passes: list[dict[str, Any]] = []
    for name, pmin, pmax, size in plan:
        if size is None:  # from the minimum, warm
            _settle(router, lo, lo, lo, delays)
        _settle(router, pmin, pmax, size, delays)
        before = ray.get(router.server_info.remote())["autoscaling"]
        with PoolSampler(router) as sampler:
            results, duration, meter = asyncio.run(
                run_pass(make_client(), requests, offsets, warmups))
        after = ray.get(router.server_info.remote())["autoscaling"]
        m = record(f"{a.target}, {name}", results, duration, meter)
        known = {c["worker_id"] for c in before["cold_starts"]}  # (worker ids are not reused)
        starts = [c for c in after["cold_starts"] if c["worker_id"] not in known]
        decisions = {k: v - before["decisions"].get(k, 0) for k, v in after["decisions"].items()
                     if v - before["decisions"].get(k, 0)}
        passes.append({"pass": name, "min_workers": pmin, "max_workers": pmax,
                       **sampler.figures(), "duration_s": duration,
                       "ttft_p50_ms": m.get("median_ttft_ms", 0.0),
                       "ttft_p99_ms": m.get("p99_ttft_ms", 0.0),
                       "completed": m["completed"], "failed": m["failed"],
                       "output_throughput": m["output_throughput"],
                       "decisions": decisions, "cold_starts": starts})
    print(format_passes(passes), flush=True)
    return {"ramp": a.ramp, "delays": delays, "passes": passes}


def format_passes(passes: list[dict[str, Any]]) -> str:
    lines = [f"{'pass':<12}{'worker-s':>10}{'mean':>6}{'max':>5}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'parked s':>10}{'lost':>6}{'tok/s':>8}"]
    for p in passes:
        lines.append(f"{p['pass']:<12}{p['worker_seconds']:>10.0f}{p['mean_workers']:>6.2f}"
                     f"{p['max_workers']:>5}{p['ttft_p50_ms'] / 1000:>9.2f}s"
                     f"{p['ttft_p99_ms'] / 1000:>9.2f}s{p['parked_stream_seconds']:>10.0f}"
                     f"{p['failed']:>6}{p['output_throughput']:>8.1f}")
    for p in passes:
        for c in p["cold_starts"]:
            lines.append(f"{p['pass']}: {c['worker_id']} ({c['reason']}): pressure to serving "
                         f"{c['pressure_to_serving_s']:.1f} s, cold start {c['cold_start_s']:.1f} s "
                         f"(model load {c['load_s']:.1f} s)")
        if p["decisions"]:
            lines.append(f"{p['pass']}: decisions " + ", ".join(
                f"{k} {v}" for k, v in sorted(p["decisions"].items())))
    return "\n".join(lines)
