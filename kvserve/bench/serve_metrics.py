"""Metric math and the printed block of `kvserve bench serve` (vLLM `bench serve` names).

Definitions, per request, all from the client's clock:
- TTFT: request sent -> first chunk that carries generated tokens.
- ITL: the gaps between successive token-carrying chunks. A chunk may hold several tokens
  (the service coalesces each engine step's tokens); its gap is counted once, as vLLM does.
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token.
- E2EL: request sent -> last byte of the response.
Goodput counts the completed requests that meet every given SLO (in ms).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# metric name in --goodput -> the per-request figure it bounds
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (99.0,)


@dataclass
class RequestResult:
    """What one request did, as seen by the client."""

    success: bool = False
    prompt_len: int = 0  # the server's count when it reports usage, else the client's
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between token-carrying chunks
    latency: float = 0.0  # E2EL, seconds
    start: float = 0.0  # perf_counter when sent
    error: str = ""
    generated_text: str = ""
    worker: str = ""  # the worker that served it, when the server names one

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None with fewer than two tokens."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput takes NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}, got {item!r}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name}: {value!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"--goodput {name}: must be a positive number of ms, got {value!r}")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a completed request is within every SLO; TPOT of a 1-token request is 0."""
    if not r.success:
        return False
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(got[name] * 1000.0 <= ms for name, ms in slos.items())


def _stats(prefix: str, values_s: Iterable[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pXX in ms of `values_s` (seconds); zeros when there are none."""
    ms = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    empty = ms.size == 0
    out = {
        f"mean_{prefix}_ms": 0.0 if empty else float(ms.mean()),
        f"median_{prefix}_ms": 0.0 if empty else float(np.median(ms)),
        f"std_{prefix}_ms": 0.0 if empty else float(ms.std()),
    }
    for p in percentiles:
        key = f"p{p:g}_{prefix}_ms"
        out[key] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The benchmark's figures from its per-request results and its wall time (seconds)."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "cached_input_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        m["request_goodput"] = good / duration
        m["goodput_slos_ms"] = dict(slos)
    m.update(_stats("ttft", (r.ttft for r in ok), percentiles))
    m.update(_stats("tpot", (t for r in ok if (t := r.tpot) is not None), percentiles))
    m.update(_stats("itl", (g for r in ok for g in r.itl), percentiles))
    m.update(_stats("e2el", (r.latency for r in ok), percentiles))
    return m


def format_block(
    m: dict[str, Any],
    title: str = "Serving Benchmark Result",
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    max_concurrency: int | None = None,
) -> str:
    """The result block in `vllm bench serve`'s layout (50 columns)."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40}{value:<10{fmt}}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    if m.get("cached_input_tokens"):
        row("Cached input tokens (server):", m["cached_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    if "request_goodput" in m:
        row("Request goodput (req/s):", m["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    if "cpu_ms_per_output_token" in m:
        row("CPU per output token (ms):", m["cpu_ms_per_output_token"], ".2f")
    sections = (
        ("ttft", "TTFT", "Time to First Token"),
        ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl", "ITL", "Inter-token Latency"),
        ("e2el", "E2EL", "End-to-end Latency"),
    )
    for key, short, long in sections:
        lines.append(f"{long:-^50}")
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"], ".2f")
        row(f"Median {short} (ms):", m[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", m[f"p{p:g}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def compare(engine: dict[str, Any], target: dict[str, Any]) -> dict[str, float]:
    """The two headline figures: output tok/s ratio target/engine and the TTFT p50 overhead."""
    base = engine["output_throughput"]
    c = {
        "output_throughput_ratio": target["output_throughput"] / base if base > 0 else 0.0,
        "ttft_p50_overhead_ms": target["median_ttft_ms"] - engine["median_ttft_ms"],
        "ttft_mean_overhead_ms": target["mean_ttft_ms"] - engine["mean_ttft_ms"],
        "e2el_p50_overhead_ms": target["median_e2el_ms"] - engine["median_e2el_ms"],
    }
    cpu = "cpu_ms_per_output_token"
    if engine.get(cpu) and target.get(cpu):
        c["cpu_per_token_ratio"] = target[cpu] / engine[cpu]
    return c
