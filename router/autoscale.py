"""The autoscaling policy: how many workers the load wants (pure, no Ray).

`recommend` reads the pool as the router's last poll saw it (`PoolLoad`) and returns the
workers it wants and why; `Autoscaler` applies Ray Serve's delays to those
recommendations: a change is made once the recommendation has pointed the same way
(up, or down) for `upscale_delay_s` / `downscale_delay_s` (`downscale_to_zero_delay_s`
from one worker to none, where set), and the streak starts over after
each change. Bounds are enforced at once, and so is the first worker for requests that wait
with none serving (scale from zero).

The signals, over the serving workers (those that take requests):

- KV demand: device blocks the streams hold plus the blocks the parked streams need back.
  Parked streams are work that does not fit: they count as demand, so a pool that parks
  is under pressure even while its device KV looks merely full. Use = demand over the
  device blocks of the serving *and starting* workers (a worker still starting counts as
  capacity: the policy does not add a second one for the load the first one will take).
- Waiting requests: in the engines' queues, plus those waiting at the router for a worker.
- TTFT: the 90th percentile over the last `ttft_window_s` (optional target).

Up (`kv_pressure`, `queue`, `ttft`): KV use >= `upscale_kv_use` sizes the pool to the
demand at the middle of the two KV thresholds (at least one more); waiting requests per
worker >= `upscale_waiting`, or the TTFT p90 >= `upscale_ttft_s` (judged only while no
worker starts: TTFT lags), add one. Down (`low_load`, `idle`): nothing waits, no worker
starts or drains, and the load would fit one worker fewer at no more than
`downscale_kv_use` of its KV and batch slots (so that the next poll does not want it back);
an idle pool goes down to `min_workers`, to zero where that is 0. At most `max_step` workers
are added per decision, and one removed (one drain at a time).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

UP_REASONS = ("below_min", "no_worker", "kv_pressure", "queue", "ttft")
DOWN_REASONS = ("above_max", "low_load", "idle")
# changes made without waiting for a delay: bounds, and a request with no worker to go to
IMMEDIATE = ("below_min", "above_max", "no_worker")


@dataclass
class AutoscalingConfig:
    enabled: bool = False
    min_workers: int = 1
    max_workers: int = 1
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    downscale_to_zero_delay_s: float | None = None  # 1 -> 0 (None: downscale_delay_s)
    max_step: int = 1  # workers added per decision at most
    upscale_kv_use: float = 0.9  # KV demand (parked counted) over capacity
    downscale_kv_use: float = 0.5  # what one worker fewer would be at most
    upscale_waiting: float = 5.0  # waiting requests per worker
    upscale_ttft_s: float | None = None  # TTFT p90 target; None: not a signal
    ttft_window_s: float = 30.0
    max_queued_requests: int = 256  # requests waiting at the router while no worker serves
    queue_timeout_s: float = 120.0  # how long such a request waits (then 503 / UNAVAILABLE)
    drain_timeout_s: float = 600.0  # a scale-down drain gives up (keeps the worker) after this

    def check(self) -> None:
        """ValueError naming the first bad setting."""
        if self.min_workers < 0:
            raise ValueError(f"min_workers must be >= 0, got {self.min_workers}")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) must not exceed max_workers "
                             f"({self.max_workers})")
        if not 0 < self.downscale_kv_use < self.upscale_kv_use <= 1:
            raise ValueError("the KV thresholds must satisfy 0 < downscale_kv_use < "
                             f"upscale_kv_use <= 1, got {self.downscale_kv_use:g} and "
                             f"{self.upscale_kv_use:g}")
        for name in ("upscale_delay_s", "downscale_delay_s", "downscale_to_zero_delay_s"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name):g}")
        for name in ("max_step", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("upscale_waiting", "ttft_window_s", "queue_timeout_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name):g}")
        if self.upscale_ttft_s is not None and self.upscale_ttft_s <= 0:
            raise ValueError(f"upscale_ttft_s must be > 0 (or unset), got {self.upscale_ttft_s:g}")

    @property
    def target_kv_use(self) -> float:
        """The KV use an upscale sizes the pool for: between the two thresholds."""
        return (self.upscale_kv_use + self.downscale_kv_use) / 2


@dataclass(frozen=True)
class PoolLoad:
    """The pool as the router's last poll saw it."""

    serving: int  # ready workers taking requests
    starting: int = 0  # started, not ready yet (waiting for resources and restarting included)
    draining: int = 0
    blocks_per_worker: int = 0  # device KV blocks of one worker (0: not known yet)
    seqs_per_worker: int = 0  # streams one worker batches at most (0: not known)
    kv_blocks_used: int = 0  # device blocks the serving workers' streams hold
    parked_blocks: int = 0  # device blocks their parked streams need back
    parked: int = 0  # parked streams
    waiting: int = 0  # requests in the engines' queues
    running: int = 0  # streams running
    inflight: int = 0  # requests routed to serving workers, not released yet
    queued: int = 0  # requests waiting at the router for a worker (none serving)
    ttft_p90_s: float | None = None  # over the recent window; None: no sample

    @property
    def capacity(self) -> int:
        return self.serving + self.starting

    @property
    def demand_blocks(self) -> int:
        return self.kv_blocks_used + self.parked_blocks

    def kv_use(self, workers: int | None = None) -> float | None:
        """KV demand (parked counted) over the blocks of `workers` workers (default: the
        capacity); None when the pool's size is not known yet."""
        n = self.capacity if workers is None else workers
        if self.blocks_per_worker <= 0 or n <= 0:
            return None
        return self.demand_blocks / (n * self.blocks_per_worker)

    def idle(self) -> bool:
        return not (self.inflight or self.waiting or self.running or self.parked or self.queued
                    or self.kv_blocks_used)

    def signals(self) -> dict[str, float]:
        """The figures the policy reads (for logs, server info and the bench)."""
        out = {"kv_use": self.kv_use() or 0.0, "demand_blocks": float(self.demand_blocks),
               "parked": float(self.parked), "waiting": float(self.waiting + self.queued),
               "running": float(self.running), "inflight": float(self.inflight)}
        if self.ttft_p90_s is not None:
            out["ttft_p90_s"] = self.ttft_p90_s
        return out


@dataclass(frozen=True)
class Recommendation:
    desired: int
    reason: str  # an UP_REASONS or DOWN_REASONS entry, or "steady"
    detail: str = ""  # the figures behind it, for the log

    def direction(self, capacity: int) -> str:
        return "up" if self.desired > capacity else "down" if self.desired < capacity else ""


def recommend(load: PoolLoad, cfg: AutoscalingConfig) -> Recommendation:
    """The workers the load wants now (before delays), and why."""
    cap = load.capacity
    if cap < cfg.min_workers:
        return Recommendation(cfg.min_workers, "below_min",
                              f"{cap} workers, min_workers {cfg.min_workers}")
    if cap > cfg.max_workers:
        return Recommendation(cfg.max_workers, "above_max",
                              f"{cap} workers, max_workers {cfg.max_workers}")
    if cap == 0:
        if load.queued:
            return Recommendation(1, "no_worker", f"{load.queued} requests wait for a worker")
        return Recommendation(0, "steady")
    up = _up(load, cfg) if cap < cfg.max_workers else None
    if up is not None:
        desired = min(up.desired, cap + cfg.max_step, cfg.max_workers)
        return Recommendation(desired, up.reason, up.detail)
    if cap > cfg.min_workers:
        down = _down(load, cfg)
        if down is not None:
            return down
    return Recommendation(cap, "steady")


def _up(load: PoolLoad, cfg: AutoscalingConfig) -> Recommendation | None:
    cap = load.capacity
    best: Recommendation | None = None
    use = load.kv_use()
    if load.serving and use is not None and use >= cfg.upscale_kv_use:
        need = math.ceil(load.demand_blocks / (cfg.target_kv_use * load.blocks_per_worker))
        best = Recommendation(max(cap + 1, need), "kv_pressure",
                              f"KV use {use:.2f} with {load.parked} parked streams counted "
                              f"(>= {cfg.upscale_kv_use:g}); {need} workers hold it at "
                              f"{cfg.target_kv_use:g}")
    waiting = load.waiting + load.queued
    if best is None and waiting / cap >= cfg.upscale_waiting:
        best = Recommendation(cap + 1, "queue", f"{waiting} requests waiting over {cap} workers "
                                                f"(>= {cfg.upscale_waiting:g} each)")
    if (best is None and cfg.upscale_ttft_s is not None and load.starting == 0
            and load.ttft_p90_s is not None and load.ttft_p90_s >= cfg.upscale_ttft_s):
        best = Recommendation(cap + 1, "ttft", f"TTFT p90 {load.ttft_p90_s:.2f} s "
                                               f"(>= {cfg.upscale_ttft_s:g} s)")
    return best


def _down(load: PoolLoad, cfg: AutoscalingConfig) -> Recommendation | None:
    cap = load.capacity
    if load.starting or load.draining or load.waiting or load.queued:
        return None
    if load.idle():
        return Recommendation(cap - 1, "idle", "no request in flight")
    if cap < 2:
        return None
    fewer = cap - 1
    use = load.kv_use(fewer)
    if use is None or use > cfg.downscale_kv_use:
        return None
    if load.seqs_per_worker and load.running / (fewer * load.seqs_per_worker) \
            > cfg.downscale_kv_use:
        return None
    if (cfg.upscale_ttft_s is not None and load.ttft_p90_s is not None
            and load.ttft_p90_s >= cfg.upscale_ttft_s * cfg.downscale_kv_use / cfg.upscale_kv_use):
        return None  # (TTFT near its target: one worker fewer would cross it)
    return Recommendation(fewer, "low_load", f"KV use on {fewer} workers would be {use:.2f} "
                                             f"(<= {cfg.downscale_kv_use:g})")


@dataclass(frozen=True)
class Decision:
    """A change to make now: from `current` to `desired` workers."""

    direction: str  # "up" or "down"
    reason: str
    current: int
    desired: int
    detail: str = ""
    pressure_s: float = 0.0  # how long the recommendation had held (the delay served)
    at: float = 0.0  # when (the Autoscaler's clock)


@dataclass
class Autoscaler:
    """Recommendations held for Ray Serve's delays become decisions."""

    cfg: AutoscalingConfig
    clock: Callable[[], float] = time.monotonic
    last: Recommendation | None = None  # the latest recommendation
    _since: float | None = None  # when the current streak began
    _direction: str = ""  # its direction
    _capacity: int = 0  # the pool's size at the last step
    decisions: list[Decision] = field(default_factory=list)  # the latest few, newest last

    def step(self, load: PoolLoad) -> Decision | None:
        """Read one poll's load; a decision when one is due now."""
        now = self.clock()
        rec = self.last = recommend(load, self.cfg)
        cap = self._capacity = load.capacity
        direction = rec.direction(cap)
        if not direction:
            self._since, self._direction = None, ""
            return None
        if direction != self._direction or self._since is None:
            self._since, self._direction = now, direction
        held = now - self._since
        delay = self._delay(direction, cap)
        if rec.reason not in IMMEDIATE and held < delay:
            return None
        self._since, self._direction = None, ""  # a change starts the next streak afresh
        d = Decision(direction, rec.reason, cap, rec.desired, rec.detail, held, now)
        self.decisions = [*self.decisions[-19:], d]
        return d

    def pending(self) -> dict[str, float | str] | None:
        """The streak under way: its direction, reason and seconds until it acts."""
        if self._since is None or self.last is None:
            return None
        delay = self._delay(self._direction, self._capacity)
        return {"direction": self._direction, "reason": self.last.reason,
                "in_s": max(0.0, delay - (self.clock() - self._since))}

    def _delay(self, direction: str, capacity: int) -> float:
        """Ray Serve's: upscale_delay_s, downscale_delay_s, and from one worker to none
        downscale_to_zero_delay_s where set."""
        if direction == "up":
            return self.cfg.upscale_delay_s
        if capacity == 1 and self.cfg.downscale_to_zero_delay_s is not None:
            return self.cfg.downscale_to_zero_delay_s
        return self.cfg.downscale_delay_s

    def reset(self) -> None:
        """Forget the streak (the bounds changed)."""
        self._since, self._direction = None, ""
