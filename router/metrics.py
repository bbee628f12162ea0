"""The router's Prometheus metrics, exported through `ray.util.metrics` (tags: the policy,
and the served model, one router per base model).

`kvserve_router_decisions` counts each successful pick by kind: the policy's "prefix"
decisions are split by where the matched prefix lives, `device_affinity` when the chosen
worker holds all of it in device memory (or had it routed there just now), else
`host_affinity` (some of it is only in its host tier).

The autoscaling series: the workers the policy wants and those there are (serving, starting,
draining), its decisions by direction and reason, the requests waiting for a worker while
none serves, and each new worker's cold start (from the decision to its first poll as ready).

The migration series count, per worker, the streams and snapshot bytes moved in and out,
the moves that failed on their target, the sessions re-pinned there, and its drain state.
"""

from __future__ import annotations

from kvserve.router.autoscale import DOWN_REASONS, UP_REASONS
from kvserve.router.policy import Decision, WorkerView
from kvserve.workers.metrics import zero

DRAIN_STATES = {"serving": 0, "draining": 1, "drained": 2}  # kvserve_worker_draining values

# the decision kinds each policy can produce
POLICY_KINDS = {
    "affinity": ("device_affinity", "host_affinity", "session", "least_loaded"),
    "least_loaded": ("least_loaded",),
    "round_robin": ("round_robin",),
}

# every router series: its base model and routing policy (one router per base model)
ROUTER_TAGS = ("model", "policy")


def decision_kind(d: Decision, chosen: WorkerView, block_hashes: list[int]) -> str:
    if d.reason != "prefix":
        return d.reason
    matched = block_hashes[: d.matched_blocks]
    on_device = all(h in chosen.held_device or h in chosen.pending for h in matched)
    return "device_affinity" if on_device else "host_affinity"


MOVE_REASONS = ("rebalance", "drain", "operator", "parked")
MOVE_KEYS = ("reason", "method", "outcome")
STALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BYTE_BUCKETS = tuple(float(1 << k) for k in range(16, 34, 2))  # 64 KiB .. 8 GiB
HANDOFF_BUCKETS = (0.001, 0.0025, *STALL_BUCKETS)


class RouterMetrics:
    def __init__(self, policy: str, worker_ids: list[str] = (), model: str = "") -> None:
        from ray.util.metrics import Counter, Gauge

        tags = {"policy": policy, "model": model}
        self.decisions = Counter(
            "kvserve_router_decisions", "successful routing decisions, by kind",
            tag_keys=(*ROUTER_TAGS, "kind")).set_default_tags(tags)
        self.retries = Counter(
            "kvserve_router_retries",
            "picks for a request whose earlier worker died before its first token",
            tag_keys=ROUTER_TAGS).set_default_tags(tags)
        self.alive = Gauge("kvserve_router_workers_alive", "workers the router routes to",
                           tag_keys=ROUTER_TAGS).set_default_tags(tags)
        for kind in POLICY_KINDS.get(policy, ()):
            zero(self.decisions, {"kind": kind})
        zero(self.retries)
        self.migration = MigrationMetrics(policy, list(worker_ids), model)
        self.disagg = DisaggMetrics(policy, model)
        self.autoscaler = AutoscalerMetrics(policy, model)

    def picked(self, d: Decision, chosen: WorkerView, block_hashes: list[int], retry: bool) -> None:
        self.decisions.inc(tags={"kind": decision_kind(d, chosen, block_hashes)})
        if retry:
            self.retries.inc()

    def workers_alive(self, views: list[WorkerView]) -> None:
        """Called after each poll: also re-exports the drain states (Ray exports a gauge's
        value once per report, so one set once at start would vanish)."""
        self.alive.set(sum(v.alive for v in views))
        self.migration.refresh()
        self.autoscaler.refresh()



class DisaggMetrics:
    """Disaggregated serving: hand-offs by outcome, their time and bytes, and the requests
    prefilled where they decode, by reason (router/disagg.py)."""

    def __init__(self, policy: str, model: str = "") -> None:
        from ray.util.metrics import Counter, Histogram

        tags = {"policy": policy, "model": model}
        self.handoffs = Counter(
            "kvserve_disagg_handoffs", "streams handed from a prefill to a decode worker, by "
            "outcome (moved, recomputed, failed, kept, finished, gone)",
            tag_keys=(*ROUTER_TAGS, "outcome")).set_default_tags(tags)
        self.seconds = Histogram(
            "kvserve_disagg_handoff_seconds", "time a handed-off stream ran on neither worker "
            "(freeze, copy, commit, release)", boundaries=list(HANDOFF_BUCKETS),
            tag_keys=ROUTER_TAGS).set_default_tags(tags)
        self.bytes = Histogram(
            "kvserve_disagg_handoff_bytes", "KV bytes of a hand-off",
            boundaries=list(BYTE_BUCKETS), tag_keys=ROUTER_TAGS).set_default_tags(tags)
        self.local = Counter(
            "kvserve_disagg_local_prefills", "requests of a disaggregated deployment prefilled "
            "where they decode, by reason", tag_keys=(*ROUTER_TAGS, "reason")).set_default_tags(tags)
        self.zero()

    def zero(self) -> None:
        from kvserve.router.disagg import LOCAL_REASONS
        from kvserve.router.handoff import OUTCOMES

        for o in OUTCOMES:
            zero(self.handoffs, {"outcome": o})
        for r in LOCAL_REASONS:
            zero(self.local, {"reason": r})

    def handoff(self, outcome: str, seconds: float, nbytes: int) -> None:
        self.handoffs.inc(tags={"outcome": outcome})
        if outcome == "moved":
            self.seconds.observe(seconds)
            self.bytes.observe(nbytes)

    def local_prefill(self, reason: str) -> None:
        self.local.inc(tags={"reason": reason})


ROUND_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


class MigrationMetrics:
    """Stream and session moves and drains, per worker (the mover records them)."""

    def __init__(self, policy: str, worker_ids: list[str], model: str = "") -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = {"policy": policy, "model": model}
        keys = (*ROUTER_TAGS, "worker", "direction")
        self.streams = Counter("kvserve_migration_streams", "streams moved, by worker and "
                               "direction", tag_keys=keys).set_default_tags(tags)
        self.bytes = Counter("kvserve_migration_bytes", "stream snapshot bytes moved, by worker "
                             "and direction", tag_keys=keys).set_default_tags(tags)
        self.failures = Counter("kvserve_migration_failures", "moves that failed on their "
                                "target worker (the stream went back to its source)",
                                tag_keys=(*ROUTER_TAGS, "worker")).set_default_tags(tags)
        self.sessions = Counter("kvserve_migration_sessions", "sessions re-pinned to a worker, "
                                "their host-cached prefix with them",
                                tag_keys=(*ROUTER_TAGS, "worker")).set_default_tags(tags)
        self.draining = Gauge("kvserve_worker_draining", "0 serving, 1 draining, 2 drained",
                              tag_keys=(*ROUTER_TAGS, "worker")).set_default_tags(tags)
        self.moves = Counter("kvserve_stream_moves", "stream moves by reason (rebalance, drain, "
                             "operator, parked), method (live, snapshot) and outcome (moved, "
                             "refused, failed)", tag_keys=(*ROUTER_TAGS, *MOVE_KEYS)
                             ).set_default_tags(tags)
        self.stall = Histogram("kvserve_stream_move_stall_seconds", "time a moved stream ran "
                               "on neither worker, by method (live: the final stage)",
                               boundaries=list(STALL_BUCKETS), tag_keys=(*ROUTER_TAGS, "method")
                               ).set_default_tags(tags)
        self.rounds = Histogram("kvserve_stream_move_rounds", "copy rounds of a live move "
                                "(pre-copy rounds and the final stage)",
                                boundaries=list(ROUND_BUCKETS), tag_keys=ROUTER_TAGS
                                ).set_default_tags(tags)
        for reason in MOVE_REASONS:
            for method in ("live", "snapshot"):
                for outcome in ("moved", "refused", "failed"):
                    zero(self.moves, {"reason": reason, "method": method, "outcome": outcome})
        self.states = {w: "serving" for w in worker_ids}
        for w in worker_ids:
            for d in ("in", "out"):
                zero(self.streams, {"worker": w, "direction": d})
                zero(self.bytes, {"worker": w, "direction": d})
            zero(self.failures, {"worker": w})
            zero(self.sessions, {"worker": w})
        self.refresh()

    def add_worker(self, w: str) -> None:
        """A worker added by a resize: its series start at zero too."""
        for d in ("in", "out"):
            zero(self.streams, {"worker": w, "direction": d})
            zero(self.bytes, {"worker": w, "direction": d})
        zero(self.failures, {"worker": w})
        zero(self.sessions, {"worker": w})
        self.drain_state(w, "serving")

    def moved(self, src: str, dst: str, nbytes: int) -> None:
        for w, d in ((src, "out"), (dst, "in")):
            self.streams.inc(tags={"worker": w, "direction": d})
            if nbytes:
                self.bytes.inc(nbytes, tags={"worker": w, "direction": d})

    def stream_move(self, reason: str, method: str, outcome: str, res: dict) -> None:
        self.moves.inc(tags={"reason": reason, "method": method, "outcome": outcome})
        if outcome == "moved":
            self.stall.observe(res.get("stall_ms", 0.0) / 1e3, tags={"method": method})
            if method == "live":
                self.rounds.observe(res.get("rounds", 0))

    def failed(self, dst: str) -> None:
        self.failures.inc(tags={"worker": dst})

    def session_moved(self, dst: str) -> None:
        self.sessions.inc(tags={"worker": dst})

    def drain_state(self, worker: str, state: str) -> None:
        self.states[worker] = state
        self.draining.set(DRAIN_STATES[state], tags={"worker": worker})

    def refresh(self) -> None:
        for w, state in self.states.items():
            self.draining.set(DRAIN_STATES[state], tags={"worker": w})


POOL_STATES = ("serving", "starting", "draining")


class AutoscalerMetrics:
    """The pool's size as the autoscaling policy wants it and as it is, and its decisions."""

    def __init__(self, policy: str, model: str = "") -> None:
        from ray.util.metrics import Counter, Gauge

        tags = {"policy": policy, "model": model}
        self.desired = Gauge("kvserve_autoscaler_desired_workers", "workers the autoscaling "
                             "policy wants (the fixed count when it is off)",
                             tag_keys=ROUTER_TAGS).set_default_tags(tags)
        self.workers = Gauge("kvserve_autoscaler_workers", "workers by state: serving, "
                             "starting (waiting for resources included), draining",
                             tag_keys=(*ROUTER_TAGS, "state")).set_default_tags(tags)
        self.queued = Gauge("kvserve_autoscaler_queued_requests", "requests waiting at the "
                            "router for a worker while none serves", tag_keys=ROUTER_TAGS
                            ).set_default_tags(tags)
        self.decisions = Counter("kvserve_autoscaler_decisions", "pool size changes the "
                                 "autoscaling policy made, by direction and reason",
                                 tag_keys=(*ROUTER_TAGS, "direction", "reason")
                                 ).set_default_tags(tags)
        # gauges, not a histogram: a histogram is exported only once observed, and starts
        # are rare; each start sets them (0 until one)
        self.cold_start = Gauge("kvserve_autoscaler_cold_start_seconds", "the latest worker "
                                "the policy started: from the decision to its serving "
                                "(placement, start, model load)", tag_keys=ROUTER_TAGS
                                ).set_default_tags(tags)
        self.pressure = Gauge("kvserve_autoscaler_pressure_to_serving_seconds", "the latest "
                              "worker the policy started: from the first poll that wanted it "
                              "to its serving", tag_keys=ROUTER_TAGS).set_default_tags(tags)
        for reason in UP_REASONS:
            zero(self.decisions, {"direction": "up", "reason": reason})
        for reason in DOWN_REASONS:
            zero(self.decisions, {"direction": "down", "reason": reason})
        self.values: dict[str, float] = {"desired": 0, "queued": 0, "cold_start": 0.0,
                                         "pressure": 0.0, **{s: 0 for s in POOL_STATES}}
        self.refresh()

    def pool(self, desired: int, counts: dict[str, int], queued: int) -> None:
        self.values.update(desired=desired, queued=queued, **counts)
        self.refresh()

    def decided(self, direction: str, reason: str) -> None:
        self.decisions.inc(tags={"direction": direction, "reason": reason})

    def started(self, cold_start_s: float, pressure_s: float) -> None:
        self.values.update(cold_start=cold_start_s, pressure=pressure_s)
        self.refresh()

    def refresh(self) -> None:
        """(Re-)export the gauges: Ray reports a gauge's value once per period."""
        v = self.values
        self.desired.set(v["desired"])
        self.queued.set(v["queued"])
        self.cold_start.set(v["cold_start"])
        self.pressure.set(v["pressure"])
        for s in POOL_STATES:
            self.workers.set(v.get(s, 0), tags={"state": s})
