"""The autoscaling policy at work in the router (the policy: router/autoscale.py).

After each poll the router's `PoolScaler.tick` reads the pool's load from what the poll saw
(each serving worker's device KV, its parked streams and the blocks they need back, waiting
and running requests, in-flight slots, first-token times over the recent window) and asks
the policy. Up: new worker actors start (`kvserve-worker-<i>`, the resize path); each takes
requests once it answers, and the planner's live rebalancing and parked moves carry
pressured workers' streams to it; one that no node has room for waits for resources (its
pending actor is the demand Ray's autoscaler adds a node for). Down: the least-loaded
serving worker is drained, its streams moved live to the others, and stopped; one drain at a
time. While no worker serves (scaled to zero, or all starting), a request waits here in a
bounded queue for one to become ready, and gets an answer with a retry time when the queue
is full or the wait too long.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from kvserve.router.autoscale import Autoscaler, AutoscalingConfig, Decision, PoolLoad
from kvserve.router.metrics import AutoscalerMetrics

log = logging.getLogger(__name__)

DEFAULT_START_S = 30.0  # the start time assumed before one was measured (Retry-After)
KEPT = 10  # decisions and cold starts shown in server info


class PoolScaler:
    """`router`: the RouterActor, whose views, states, mover and `_add_workers` it uses."""

    def __init__(self, router: Any, cfg: AutoscalingConfig, metrics: AutoscalerMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.router = router
        self.cfg = cfg
        self.policy = Autoscaler(cfg, clock)
        self.metrics = metrics
        self.clock = clock
        self.queued = 0  # requests waiting for a worker while none serves
        self._ready = asyncio.Event()
        self.starts: dict[int, tuple[float, Decision]] = {}  # new worker -> (when, why)
        self.cold_starts: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()  # "up:kv_pressure" -> decisions
        self.blocks_per_worker = 0  # the last known (kept while no worker serves)
        self.last_load: PoolLoad | None = None

    @property
    def active(self) -> bool:
        """The pool may change size by itself (so the router polls every period)."""
        return self.cfg.enabled and (self.cfg.max_workers > 1 or self.cfg.min_workers == 0)

    # ---- the load ---------------------------------------------------------------------------
    def serving(self) -> list[Any]:
        r = self.router
        gone = r.mover.drained | r.mover.draining
        return [v for v in r.views if v.alive and v.idx not in gone]

    def pool_load(self) -> PoolLoad:
        r = self.router
        gone = r.mover.drained | r.mover.draining
        serving = self.serving()
        starting = [v for v in r.views if not v.alive and v.idx not in gone
                    and v.idx not in r.never_placed
                    and not r.states[v.idx].state.startswith("failed")]
        sizes = [v.kv_blocks_total for v in serving if v.kv_blocks_total > 0]
        if sizes:
            self.blocks_per_worker = int(sum(sizes) / len(sizes))
        parked = [p for v in serving for p in r.mover.parked.get(v.idx, ())]
        now = self.clock()
        window = [s for v in serving for t, s in v.ttft_recent
                  if now - t <= self.cfg.ttft_window_s]
        return PoolLoad(
            serving=len(serving), starting=len(starting),
            draining=len(r.mover.draining - r.mover.drained),
            blocks_per_worker=self.blocks_per_worker,
            seqs_per_worker=int(r.cfg.engine.get("max_num_seqs") or 0),
            kv_blocks_used=sum(max(0, v.kv_blocks_total - v.kv_blocks_free) for v in serving),
            parked_blocks=sum(p.blocks_needed for p in parked), parked=len(parked),
            waiting=sum(v.waiting for v in serving), running=sum(v.running for v in serving),
            inflight=sum(v.inflight for v in serving), queued=self.queued,
            ttft_p90_s=float(np.percentile(window, 90)) if window else None)

    # ---- deciding -----------------------------------------------------------------------------
    def tick(self) -> Decision | None:
        """After a poll (or when a request queues with no worker): decide, and act."""
        load = self.last_load = self.pool_load()
        d = self.policy.step(load) if self.cfg.enabled else None
        if d is not None and d.direction == "down" and load.draining:
            d = None  # one drain at a time (a bound it exceeds is kept at the next tick)
        if d is not None:
            self.counts[f"{d.direction}:{d.reason}"] += 1
            self.metrics.decided(d.direction, d.reason)
            log.warning("autoscaler: %s from %d to %d workers (%s: %s; wanted for %.1f s)",
                        d.direction, d.current, d.desired, d.reason, d.detail, d.pressure_s)
            if d.direction == "up":
                self._up(d)
            else:
                self._down(d)
            load = self.last_load = self.pool_load()
        self._export(load)
        return d

    def _up(self, d: Decision) -> None:
        now = self.clock()
        for idx in self.router._add_workers(d.desired - d.current):
            self.starts[idx] = (now, d)

    def _down(self, d: Decision) -> None:
        r = self.router
        serving = self.serving()
        if not serving:  # (those starting: the next tick sees them ready, or stops waiting)
            return
        parked = {i: sum(p.blocks_needed for p in r.mover.parked.get(i, ())) for i in
                  (v.idx for v in serving)}
        # the least loaded; on a tie the newest (worker-0 stays, its name a stable anchor)
        v = min(serving, key=lambda v: (v.inflight, v.running + v.waiting + v.parked,
                                        v.kv_blocks_total - v.kv_blocks_free + parked[v.idx],
                                        -v.idx))
        task = r.mover.start_drain(v.idx, self.cfg.drain_timeout_s)
        task.add_done_callback(lambda t, w=v.worker_id: self._drained(w, t))

    def _drained(self, worker: str, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        res = task.exception() or task.result()
        if isinstance(res, BaseException) or not res.get("drained"):
            log.error("autoscaler: %s could not be drained, and serves on: %s", worker, res)
        else:
            log.warning("autoscaler: %s drained (%d streams moved live or by snapshot) and "
                        "stopped", worker, res.get("moved", 0))

    def _export(self, load: PoolLoad) -> None:
        if self.cfg.enabled and self.policy.last is not None:
            desired = self.policy.last.desired
        else:
            desired = len([v for v in self.router.views
                           if v.idx not in self.router.mover.drained
                           | self.router.mover.draining])
        self.metrics.pool(desired, {"serving": load.serving, "starting": load.starting,
                                    "draining": load.draining}, self.queued)

    def configure(self, changes: dict[str, Any]) -> AutoscalingConfig:
        """New settings (a redeploy, an operator, a bench); ValueError names a bad one."""
        cfg = dataclasses.replace(self.cfg, **changes)
        cfg.check()
        self.cfg = self.policy.cfg = cfg
        self.policy.reset()
        log.warning("autoscaler: %s", "off" if not cfg.enabled else
                    f"{cfg.min_workers}..{cfg.max_workers} workers, delays up "
                    f"{cfg.upscale_delay_s:g} s, down {cfg.downscale_delay_s:g} s")
        return cfg

    # ---- workers coming up --------------------------------------------------------------------
    def worker_ready(self, idx: int, load_s: float) -> None:
        """Worker `idx` answered as ready: requests waiting for a worker go to it; one that
        the policy started reports its cold start."""
        self._ready.set()
        started = self.starts.pop(idx, None)
        if started is None:
            return
        at, d = started
        cold = self.clock() - at
        self.metrics.started(cold, cold + d.pressure_s)
        entry = {"worker_id": self.router.views[idx].worker_id, "reason": d.reason,
                 "cold_start_s": cold, "pressure_to_serving_s": cold + d.pressure_s,
                 "load_s": load_s}
        self.cold_starts = [*self.cold_starts[-(KEPT - 1):], entry]
        log.warning("autoscaler: %s serves %.1f s after the decision (model load %.1f s), "
                    "%.1f s after the load first wanted it", entry["worker_id"], cold, load_s,
                    entry["pressure_to_serving_s"])

    def wake(self) -> None:
        """A poll found a serving worker (a restart came back): waiting requests may go."""
        if self.serving():
            self._ready.set()

    async def wait_for_worker(self) -> dict[str, Any] | None:
        """A request with no worker serving waits for one (a start begins now); None once
        one serves, else the answer to give it (an error with `retry_after`)."""
        if self.queued >= self.cfg.max_queued_requests:
            return self._refusal(f"{self.queued} requests already wait for a worker to start "
                                 "(max_queued_requests)")
        self.queued += 1
        deadline = self.clock() + self.cfg.queue_timeout_s
        try:
            self.tick()  # from zero a worker starts at once, not at the next poll
            while not self.serving():
                left = deadline - self.clock()
                if left <= 0:
                    return self._refusal(f"no worker became ready within "
                                         f"{self.cfg.queue_timeout_s:g} s (queue_timeout_s)")
                self._ready.clear()
                try:
                    await asyncio.wait_for(self._ready.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.queued -= 1
        return None

    def _refusal(self, why: str) -> dict[str, Any]:
        r = self.router
        starting = {v.worker_id: r.states[v.idx].state for v in r.views
                    if v.idx in self.starts}
        retry = self.retry_after()
        what = ("; ".join(f"{w} is {s}" for w, s in starting.items())
                or "no worker is starting")
        return {"error": "unavailable", "retry_after": retry,
                "message": f"no worker is serving yet: {why}; {what}; retry in about "
                           f"{retry} s"}

    def retry_after(self) -> int:
        """Seconds until the soonest starting worker should serve (by the last start's time)."""
        typical = self.cold_starts[-1]["cold_start_s"] if self.cold_starts else DEFAULT_START_S
        now = self.clock()
        left = [typical - (now - at) for at, _ in self.starts.values()]
        return max(1, math.ceil(min(left) if left else typical))

    # ---- introspection ------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        load = self.pool_load()  # as it is now (the recommendation is the last tick's)
        now = self.clock()
        rec = self.policy.last
        c = self.cfg
        # a fixed pool's bounds are its size
        lo, hi = (c.min_workers, c.max_workers) if c.enabled else (load.capacity,) * 2
        return {
            "enabled": c.enabled, "min_workers": lo, "max_workers": hi,
            "upscale_delay_s": c.upscale_delay_s, "downscale_delay_s": c.downscale_delay_s,
            "desired_workers": rec.desired if (c.enabled and rec) else load.capacity,
            "serving_workers": load.serving, "starting_workers": load.starting,
            "draining_workers": load.draining, "queued_requests": self.queued,
            "reason": rec.reason if (c.enabled and rec) else "",
            "detail": rec.detail if (c.enabled and rec) else "",
            "pending": self.policy.pending() if c.enabled else None,
            "signals": load.signals(),
            "decisions": dict(self.counts),
            "last_decisions": [{**dataclasses.asdict(d), "age_s": now - d.at}
                               for d in self.policy.decisions[-KEPT:]],
            "cold_starts": list(self.cold_starts),
        }
