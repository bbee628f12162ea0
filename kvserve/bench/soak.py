"""`kvserve bench soak`: a steady mixed load for a given time, with optional chaos events.

It starts its own service (or uses one this process already runs, as a test does), drives
HTTP and gRPC, streaming and unary requests, sessions, disconnects, bad inputs and long
prompts (evictions) from --concurrency clients, and samples every --sample-s seconds the
RSS of each Ray process, the KV and host-tier use, the router's in-flight counts and the
ingress's slots. --chaos worker@600,router@900,ingress@1200 kills those parts at those
seconds. The report gives RSS growth per process, TTFT percentiles per minute and in the
first and last five minutes, failures by status, for each chaos event the requests in
flight, failures and time back to >= 90% throughput, and a leak check once idle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any

from kvserve.bench.common import write_json

WINDOW_S = 300.0  # "first / last five minutes"
RECOVERY_BASE_S = 60.0  # throughput before a chaos event is measured over this long
BUCKET_S = 10.0  # throughput is compared in buckets of this length


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("soak", help="soak test: steady mixed load, resource samples, chaos")
    p.add_argument("--duration", type=float, default=1800, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kv-cache-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--host-cache-gib", type=float, default=None,
                   help="host KV tier per worker (default: the engine's, a share of free RAM)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--chaos", default="",
                   help="events as WHAT@SECONDS, comma separated; WHAT: worker, router, ingress")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report (and every sample) here")
    p.set_defaults(func=cmd_soak)


def parse_chaos(spec: str, duration: float) -> list[tuple[float, str]]:
    events = []
    for part in filter(None, (x.strip() for x in spec.split(","))):
        what, _, at = part.partition("@")
        if what not in ("worker", "router", "ingress") or not at:
            raise ValueError(f"bad chaos event {part!r}: use worker@S, router@S or ingress@S")
        if not 0 < float(at) < duration:
            raise ValueError(f"chaos event {part!r} is outside the run (0..{duration:.0f} s)")
        events.append((float(at), what))
    return sorted(events)


def cmd_soak(a: argparse.Namespace) -> int:
    try:
        chaos = parse_chaos(a.chaos, a.duration)
    except ValueError as e:
        print(f"kvserve bench soak: {e}", file=sys.stderr)
        return 2
    from kvserve.deploy.config import ServeConfig
    from kvserve.deploy.serve_cli import deploy, shutdown
    from kvserve.deploy.serve_stop import free_port

    key = "soak-key"
    engine = {"kv_cache_tokens": a.kv_cache_tokens, "max_model_len": a.max_model_len,
              "num_threads": a.threads}
    if a.host_cache_gib is not None:
        engine["host_cache_gib"] = a.host_cache_gib
    cfg = ServeConfig(num_workers=a.workers, engine=engine, api_keys=[key],
                      grpc_port=free_port(), http_port=free_port())
    print(f"soak: starting the service ({a.workers} workers, KV {a.kv_cache_tokens} tokens "
          "each) ...", file=sys.stderr, flush=True)
    try:
        deploy(cfg, ray_init={"log_to_driver": False, "include_dashboard": False})
        report = run_soak(f"http://127.0.0.1:{cfg.http_port}", f"127.0.0.1:{cfg.grpc_port}",
                          key, a.duration, a.concurrency, chaos, a.max_tokens, a.sample_s,
                          a.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    finally:
        shutdown()
    report["config"] = {k: v for k, v in vars(a).items() if k != "func"}
    print(format_report(report))
    write_json(a.json, report)
    return 0 if report["verdict"]["ok"] else 1


def run_soak(
    http_url: str, grpc_target: str, api_key: str | None, duration: float, concurrency: int,
    chaos: list[tuple[float, str]], max_tokens: int = 64, sample_s: float = 5.0, seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    """Drive the load against a service whose router this process's Ray can reach."""
    import ray

    from kvserve.bench.soak_load import Load
    from kvserve.bench.soak_probe import Probe, idle_check, kill
    from kvserve.router.router import NAMESPACE, ROUTER_NAME

    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    probe = Probe(router, http_url, api_key, own_pids={os.getpid()})
    load = Load(http_url, grpc_target, api_key, max_tokens, seed)
    samples: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    t0 = time.monotonic()
    until = t0 + duration
    stop = threading.Event()

    def sampler() -> None:
        pending = list(chaos)
        while not stop.is_set():
            now = time.monotonic()
            while pending and now - t0 >= pending[0][0]:
                at, what = pending.pop(0)
                before = load.in_flight
                s = probe.sample()
                router_inflight = sum(w["inflight"] for w in s.get("workers", ()))
                try:
                    desc = kill(what, router)
                except Exception as e:
                    desc = f"kill failed: {e}"
                events.append({"what": what, "at_s": round(time.monotonic() - t0, 1),
                               "killed": desc, "client_in_flight": before,
                               "router_in_flight": router_inflight})
                log(f"soak: t={now - t0:.0f}s killed {desc}; {before} requests in flight")
            s = probe.sample()
            s["t"] -= t0
            s["client_in_flight"] = load.in_flight
            samples.append(s)
            if len(samples) % max(1, int(60 / sample_s)) == 0:
                done = len(load.outcomes)
                log(f"soak: t={s['t']:.0f}s {done} requests done, {load.in_flight} in flight")
            stop.wait(sample_s)

    start = probe.sample()
    corrections0 = _corrections(start)
    late0 = sum(w["late"] for w in start.get("workers", ()))
    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    try:
        asyncio.run(load.run(concurrency, until))
    finally:
        stop.set()
        th.join()
    idle = idle_check(probe)
    if "router_corrections" in idle:  # during this run (a restarted router counts from 0)
        idle["router_corrections"] = max(0, idle["router_corrections"] - corrections0)
        idle["late_releases"] = max(0, idle["late_releases"] - late0)
    idle["rss_mib"] = probe.sample()["rss_mib"]
    return build_report(load.outcomes, samples, events, idle, t0, duration)


def _corrections(sample: dict[str, Any]) -> int:
    return sum(w["reconciled"] for w in sample.get("workers", ()))


# ---- the report ----------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def build_report(outcomes: list[Any], samples: list[dict], events: list[dict],
                 idle: dict, t0: float, duration: float) -> dict[str, Any]:
    from kvserve.bench.soak_load import is_server_error

    outs = sorted(outcomes, key=lambda o: o.start)
    by_status: dict[str, int] = {}
    for o in outs:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    ttft = [(o.start - t0, o.ttft) for o in outs if o.ttft is not None and o.status == "ok"]
    minutes = []
    for m in range(int(duration // 60) + 1):
        xs = [v for t, v in ttft if m * 60 <= t < (m + 1) * 60]
        if xs:
            minutes.append({"minute": m, "n": len(xs), "p50_ms": _ms(_pct(xs, 50)),
                            "p99_ms": _ms(_pct(xs, 99))})
    first = [v for t, v in ttft if t < min(WINDOW_S, duration / 2)]
    last = [v for t, v in ttft if t >= duration - min(WINDOW_S, duration / 2)]
    for e in events:
        _recovery(e, outs, t0)
        _ingress_counts(e, samples)
    # failures outside chaos windows must not exist at all; inside them they are reported
    windows = [(e["at_s"], e["at_s"] + (e["recovery_s"] or duration)) for e in events]

    def in_chaos(o: Any) -> bool:
        t = o.start - t0
        return any(a - 5 <= t <= b + 5 or a <= o.end - t0 <= b + 5 for a, b in windows)

    wrong_bad = [o for o in outs if o.expected_error and not (
        o.status.startswith("http_4") or o.status in ("grpc_INVALID_ARGUMENT", "grpc_NOT_FOUND"))]
    server_errors = [o for o in outs if not o.expected_error and is_server_error(o)]
    steady_errors = [o for o in server_errors if not in_chaos(o)]
    rss = _rss_growth(samples, idle.get("rss_mib", {}), duration)
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "duration_s": duration,
        "requests": len(outs),
        "by_status": dict(sorted(by_status.items())),
        "by_kind": _by_kind(outs),
        "server_errors": len(server_errors),
        "server_errors_outside_chaos": len(steady_errors),
        "server_error_examples": [f"{o.kind} {o.status}: {o.message}" for o in steady_errors[:5]],
        "bad_inputs_not_4xx": len(wrong_bad),
        "ttft_ms": {"first_window": _summary(first), "last_window": _summary(last),
                    "window_s": min(WINDOW_S, duration / 2), "per_minute": minutes},
        "rss_mib": rss,
        "kv_peak": _peaks(samples),
        "chaos": events,
        "idle": idle,
        "samples": samples,
    }
    report["verdict"] = {
        "ok": not steady_errors and not wrong_bad and idle.get("clean", False),
        "no_5xx_outside_chaos": not steady_errors, "bad_inputs_4xx": not wrong_bad,
        "idle_clean": idle.get("clean", False),
    }
    return report


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def _summary(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "p50_ms": _ms(_pct(xs, 50)), "p90_ms": _ms(_pct(xs, 90)),
            "p99_ms": _ms(_pct(xs, 99))}


def _by_kind(outs: list[Any]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for o in outs:
        d = out.setdefault(o.kind, {})
        d[o.status] = d.get(o.status, 0) + 1
    return out


def _recovery(e: dict, outs: list[Any], t0: float) -> None:
    """Failures caused by the event, and the time until completions per bucket are back to
    >= 90% of the minute before it."""
    at = e["at_s"]
    done = [o.end - t0 for o in outs if o.status in ("ok", "left")]
    before = [t for t in done if at - RECOVERY_BASE_S <= t < at]
    base = len(before) / RECOVERY_BASE_S * BUCKET_S
    e["throughput_before_per_bucket"] = round(base, 1)
    e["recovery_s"] = None
    t = at
    last = max(done, default=at)
    while t + BUCKET_S <= last:
        n = sum(1 for x in done if t <= x < t + BUCKET_S)
        if n >= 0.9 * base:
            e["recovery_s"] = round(t + BUCKET_S - at, 1)
            break
        t += 1.0
    end = at + (e["recovery_s"] or 60.0)
    hit = [o for o in outs if o.status not in ("ok", "left") and not o.expected_error
           and (o.start - t0 <= end and o.end - t0 >= at - 1)]
    statuses: dict[str, int] = {}
    for o in hit:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    e["failed"] = len(hit)
    e["ok_after_kill"] = sum(1 for o in outs if o.status == "ok" and o.start - t0 <= at <= o.end - t0)
    e["failed_by_status"] = statuses
    e["failure_examples"] = sorted({o.message[:160] for o in hit})[:4]


def _ingress_counts(e: dict, samples: list[dict]) -> None:
    """Retries on another worker and picks that waited for the service, from just before the
    event to a minute after it recovered (a restarted ingress counts from 0 again)."""
    at, end = e["at_s"], e["at_s"] + (e["recovery_s"] or 60.0) + 60.0
    for key in ("ingress_retries", "ingress_pick_waits"):
        before = [s[key] for s in samples if key in s and s["t"] < at]
        after = [s[key] for s in samples if key in s and at <= s["t"] <= end]
        e[key.removeprefix("ingress_")] = max(0, max(after, default=0) - (before[-1] if before else 0))


def _rss_growth(samples: list[dict], final: dict[str, float], duration: float) -> dict[str, Any]:
    """Per process (role:pid): RSS in the first and last five minutes (medians) and growth."""
    w = min(WINDOW_S, duration / 2)
    series: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for k, v in s.get("rss_mib", {}).items():
            series.setdefault(k, []).append((s["t"], v))
    out = {}
    for k, pts in sorted(series.items()):
        a = [v for t, v in pts if t < pts[0][0] + w]
        b = [v for t, v in pts if t >= pts[-1][0] - w]
        out[k] = {"first_mib": round(statistics.median(a), 1),
                  "last_mib": round(statistics.median(b), 1),
                  "growth_mib": round(statistics.median(b) - statistics.median(a), 1),
                  "lived_s": round(pts[-1][0] - pts[0][0]), "idle_mib": round(final.get(k, 0), 1)}
    return out


def _peaks(samples: list[dict]) -> dict[str, Any]:
    ws = [w for s in samples for w in s.get("workers", ())]
    return {"kv_used_max": max((w["kv_used"] for w in ws), default=0),
            "kv_total": max((w["kv_total"] for w in ws), default=0),
            "host_used_max": max((w["host_used"] for w in ws), default=0),
            "host_cached_max": max((w.get("host_cached", 0) for w in ws), default=0),
            "host_mib_max": max((w.get("host_mib", 0) for w in ws), default=0),
            "evictions_max": max((w["evictions"] for w in ws), default=0),
            "parked_max": max((w["parked"] for w in ws), default=0),
            "inflight_max": max((w["inflight"] for w in ws), default=0)}


def format_report(r: dict[str, Any]) -> str:
    t = r["ttft_ms"]
    lines = [
        f"soak: {r['duration_s']:.0f} s, {r['requests']} requests, {r['date']}",
        f"  by status: {r['by_status']}",
        f"  server errors: {r['server_errors']} ({r['server_errors_outside_chaos']} outside "
        f"chaos windows); bad inputs not answered 4xx: {r['bad_inputs_not_4xx']}",
        f"  TTFT first {t['window_s']:.0f} s: {t['first_window']}",
        f"  TTFT last  {t['window_s']:.0f} s: {t['last_window']}",
        f"  KV/host peaks: {r['kv_peak']}",
        "  RSS (MiB, first -> last window median, growth):",
    ]
    for k, v in r["rss_mib"].items():
        lines.append(f"    {k:24s} {v['first_mib']:8.1f} -> {v['last_mib']:8.1f}  "
                     f"{v['growth_mib']:+7.1f}  (lived {v['lived_s']} s)")
    for e in r["chaos"]:
        lines.append(f"  chaos t={e['at_s']:.0f}s {e['killed']}: {e['client_in_flight']} in flight"
                     f" (router {e['router_in_flight']}), failed {e['failed']} "
                     f"{e['failed_by_status']}, back to >=90% throughput after "
                     f"{e['recovery_s']} s; ingress retries {e.get('retries')}, "
                     f"pick waits {e.get('pick_waits')}")
    lines.append(f"  idle: {({k: v for k, v in r['idle'].items() if k != 'rss_mib'})}")
    lines.append(f"  verdict: {r['verdict']}")
    return "\n".join(lines)
