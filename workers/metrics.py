"""A worker's Prometheus metrics, exported through `ray.util.metrics` (names in docs/serving.md).

Per-request metrics (counts, latencies, tokens) are recorded by a `RequestTracker` as the
request's outputs arrive; KV and queue gauges, the engine's cumulative KV counters
(evictions, restores by decision and reason, recomputed tokens, host-copy seconds) and the
restore cost model's measured figures (copy bandwidth, prefill rate) are exported from
`LLMEngine.stats()` by `WorkerMetrics.poll`, which the worker calls once a second. Every
series is tagged with the model and the worker id. Recording is local to the process
(Ray's metrics agent collects it), so nothing here costs a Ray call.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from kvserve.kvcache.restore_cost import DECISIONS, stat_key
from kvserve.outputs import RequestOutput

log = logging.getLogger(__name__)

# Seconds, on a 1-2.5-5 ladder from 1 ms (a GPU decode step) to a minute (a long CPU answer).
# Ray 2.60 exports a histogram's `_sum` from bucket midpoints, so a fine ladder also keeps
# the mean (`_sum / _count`) close.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
E2E_BUCKETS = LATENCY_BUCKETS + (120.0, 300.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
# the latest first-token times, for the router's autoscaling (its TTFT over a recent window)
RECENT_TTFT = 256
RECENT_TTFT_S = 120.0
# engine stat key -> counter name (the stats are cumulative; their increments are exported)
ENGINE_COUNTERS = {
    "evictions": "kvserve_kv_evictions",
    "restored_blocks": "kvserve_kv_restored_blocks",
    "restored_bytes": "kvserve_kv_restored_bytes",
    "tokens_recomputed": "kvserve_kv_recomputed_tokens",
    "writebacks_skipped": "kvserve_kv_writebacks_skipped",
    # speculative decoding: verifications, proposed and accepted tokens (0 without it)
    "spec_drafts": "kvserve_spec_decode_drafts",
    "spec_draft_tokens": "kvserve_spec_decode_draft_tokens",
    "spec_accepted_tokens": "kvserve_spec_decode_accepted_tokens",
}
COPY_SECONDS = {"d2h": "copy_seconds_d2h", "h2d": "copy_seconds_h2d"}
# the restore cost model's measured figures: copy bandwidth per direction, prefill rate
COPY_GBPS = {"d2h": "host_copy_gbps_d2h", "h2d": "host_copy_gbps_h2d"}
# gauge name -> engine stat key
ENGINE_GAUGES = {
    "kvserve_requests_waiting": "waiting",
    "kvserve_kv_device_blocks_used": "kv_blocks_used",
    "kvserve_kv_device_blocks_capacity": "kv_blocks_total",
    "kvserve_kv_host_blocks_used": "host_blocks_used",
    "kvserve_kv_host_blocks_capacity": "host_blocks_total",
    "kvserve_streams_running": "running",
    "kvserve_streams_parked": "parked",
}


def model_stem(path: str | os.PathLike[str]) -> str:
    """A model's name from its file or folder (as `ServeConfig.model_name` derives it)."""
    name = os.path.basename(str(path).rstrip("/"))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def zero(counter: Any, tags: dict[str, str] | None = None) -> None:
    """Export a counter series at 0 before its first event, as Prometheus clients do
    (Ray's public `inc` refuses 0; its record path does not)."""
    try:
        counter._record(0, tags=tags)
    except Exception:  # a Ray without that path: the series appears at its first event
        log.debug("cannot pre-register %s at 0", counter, exc_info=True)


class _Unexported:
    """A metric of a worker built in-process (tests, tools), outside a Ray actor: recorded
    nowhere. Ray would export it from whatever driver runs the process, under the labels of
    a worker that does not serve."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_default_tags(self, tags: dict[str, str]) -> _Unexported:
        return self

    def inc(self, *args: Any, **kwargs: Any) -> None:
        pass

    observe = set = _record = inc


def _in_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class WorkerMetrics:
    def __init__(self, model: str, worker_id: str, role: str = "mixed") -> None:
        """`role`: the worker's (mixed, prefill, decode); the time to first token and per
        output token carry it, so disaggregated serving shows each role's share."""
        if _in_actor():
            from ray.util.metrics import Counter, Gauge, Histogram
        else:
            Counter = Gauge = Histogram = _Unexported  # noqa: N806

        keys = ("model", "worker")
        tags = {"model": model, "worker": worker_id}

        def counter(name: str, desc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(name, desc, tag_keys=keys + extra).set_default_tags(tags)

        def gauge(name: str, desc: str) -> Any:
            return Gauge(name, desc, tag_keys=keys).set_default_tags(tags)

        def histogram(name: str, desc: str, buckets: tuple[float, ...],
                      extra: tuple[str, ...] = ()) -> Any:
            return Histogram(name, desc, boundaries=list(buckets),
                             tag_keys=keys + extra).set_default_tags(tags)

        self.role_tags = {"role": role}

        self.received = counter("kvserve_requests_received", "requests that reached this worker")
        self.finished = counter("kvserve_requests_finished",
                                "requests ended, by reason (stop, length, abort, error)", ("reason",))
        self.running = gauge("kvserve_requests_running",
                             "requests in flight on this worker (queued, running or parked)")
        self.ttft = histogram("kvserve_time_to_first_token_seconds",
                              "arrival at the worker to the first generated token, by the "
                              "worker's role", LATENCY_BUCKETS, ("role",))
        self.tpot = histogram("kvserve_time_per_output_token_seconds",
                              "mean time between output tokens after the first, per request "
                              "(its share on this worker), by the worker's role",
                              LATENCY_BUCKETS, ("role",))
        self.e2e = histogram("kvserve_e2e_request_latency_seconds",
                             "arrival at the worker to the request's end", E2E_BUCKETS)
        self.queue_wait = histogram("kvserve_queue_wait_seconds",
                                    "arrival in the engine to its first scheduled step",
                                    LATENCY_BUCKETS)
        self.prompt_tokens = counter("kvserve_prompt_tokens", "prompt tokens of admitted requests")
        self.generation_tokens = counter("kvserve_generation_tokens", "tokens generated")
        self.prefix_hit_tokens = counter("kvserve_prefix_cache_hit_tokens",
                                         "prompt tokens served from the prefix cache (device or host)")
        self.gauges = {name: gauge(name, f"engine state {key!r}")
                       for name, key in ENGINE_GAUGES.items()}
        self.engine_counters = {key: counter(name, f"engine counter {key!r}")
                                for key, name in ENGINE_COUNTERS.items()}
        self.copy_seconds = counter("kvserve_kv_host_copy_seconds",
                                    "seconds spent copying KV blocks to (d2h) and from (h2d) the "
                                    "host tier", ("direction",))
        self.restores = counter("kvserve_kv_restores",
                                "parked streams brought back, by decision (copy, recompute) and "
                                "reason (cheaper_to_copy, cheaper_to_recompute, policy, not_on_host, "
                                "unmeasured)", ("decision", "reason"))
        self.copy_gbps = Gauge("kvserve_kv_host_copy_gbps",
                               "measured host-tier copy bandwidth (GB/s) by direction (d2h, h2d): "
                               "start-up figure, then a moving average of the copies",
                               tag_keys=(*keys, "direction")).set_default_tags(tags)
        self.prefill_rate = gauge("kvserve_prefill_tokens_per_s",
                                  "measured prefill rate (tokens/s) the restore choice compares "
                                  "copies with: start-up figure, then a moving average of steps")
        for c in (self.received, self.prompt_tokens, self.generation_tokens,
                  self.prefix_hit_tokens, *self.engine_counters.values()):
            zero(c)
        for d, r in DECISIONS:
            zero(self.restores, {"decision": d, "reason": r})
        for r in FINISH_REASONS:
            zero(self.finished, {"reason": r})
        for d in COPY_SECONDS:
            zero(self.copy_seconds, {"direction": d})
        self._last: dict[str, float] = {}  # the engine's cumulative counters, as last exported
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=RECENT_TTFT)  # (when, s)

    def ttft_recent(self) -> list[list[float]]:
        """[[age_s, ttft_s], ...] of the first tokens of the last RECENT_TTFT_S seconds."""
        now = time.monotonic()
        return [[now - t, s] for t, s in self.recent_ttft if now - t <= RECENT_TTFT_S]

    def set_role(self, role: str) -> None:
        self.role_tags = {"role": role}

    def request(self) -> RequestTracker:
        """A request arrived: count it and follow it to its end."""
        self.received.inc()
        return RequestTracker(self)

    def resumed(self) -> RequestTracker:
        """A stream moved here from another worker: counted as received there, finished here
        (its end-to-end time and time per token are this worker's share)."""
        track = RequestTracker(self)
        track.resumed = True
        return track

    def poll(self, stats: Mapping[str, Any], in_flight: int) -> None:
        """Export the engine's state (gauges) and its counters' growth since the last poll."""
        self.running.set(in_flight)
        for name, key in ENGINE_GAUGES.items():
            self.gauges[name].set(float(stats.get(key, 0)))
        for key, c in self.engine_counters.items():
            self._inc(c, key, stats)
        for d, key in COPY_SECONDS.items():
            self._inc(self.copy_seconds, key, stats, {"direction": d})
        for d, r in DECISIONS:
            self._inc(self.restores, stat_key(d, r), stats, {"decision": d, "reason": r})
        for d, key in COPY_GBPS.items():
            self.copy_gbps.set(float(stats.get(key, 0.0)), tags={"direction": d})
        self.prefill_rate.set(float(stats.get("prefill_tokens_per_s", 0.0)))

    def _inc(self, c: Any, key: str, stats: Mapping[str, Any], tags: dict | None = None) -> None:
        value = float(stats.get(key, 0))
        grew = value - self._last.get(key, 0.0)
        if grew > 0:
            c.inc(grew, tags=tags)
            self._last[key] = value


class RequestTracker:
    """One request's timings and tokens; `finish` records it once, whichever end it had."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.m = metrics
        self.t0 = time.monotonic()
        self.first: float | None = None  # when the first token arrived
        self.last = 0.0
        self.tokens = 0
        self.done = False
        self.resumed = False  # continues a stream that began on another worker
        self.base: int | None = None  # a resumed stream's tokens before it came here

    def output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if self.resumed and self.base is None:
            self.base = out.usage.completion_tokens - len(out.delta_token_ids)
            if self.base > 0:  # its first token, prompt and queue wait were recorded there
                self.first = self.t0
        if self.first is None and out.usage.completion_tokens > 0:
            self.first = now
            m = self.m
            m.ttft.observe(now - self.t0, tags=m.role_tags)
            m.recent_ttft.append((now, now - self.t0))
            if out.queue_s is not None:
                m.queue_wait.observe(out.queue_s)
            if out.usage.prompt_tokens > 0:
                m.prompt_tokens.inc(out.usage.prompt_tokens)
            if out.usage.cached_tokens > 0:
                m.prefix_hit_tokens.inc(out.usage.cached_tokens)
        self.last = now
        self.tokens = out.usage.completion_tokens

    def moved(self) -> None:
        """The stream left for another worker, which records its end (and all its tokens)."""
        self.done = True

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.m
        m.finished.inc(tags={"reason": reason if reason in FINISH_REASONS else "error"})
        m.e2e.observe(time.monotonic() - self.t0)
        if self.tokens > 0:
            m.generation_tokens.inc(self.tokens)
        if reason not in ("stop", "length") or self.first is None:
            return
        if self.resumed:  # the tokens made here, from the resume on
            made = self.tokens - (self.base or 0)
            if made > 0:
                m.tpot.observe((self.last - self.t0) / made, tags=m.role_tags)
        elif self.tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.tokens - 1), tags=m.role_tags)
