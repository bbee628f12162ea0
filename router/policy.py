"""Routing policies: given the router's view of the workers, pick one for a request.

Policies are pure functions of the view (no Ray), so they are easy to test and swap:
register a new one in POLICIES and name it in ServeConfig.routing_policy.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerView:
    """What the router knows about one worker."""

    idx: int
    worker_id: str
    alive: bool = False
    inflight: int = 0  # requests routed here and not yet released (len(slots) in the router)
    # slot id -> when the worker (or the pick) last vouched for it; see RouterActor._reconcile
    slots: dict[str, float] = field(default_factory=dict)
    reconciled: int = 0  # stale slots the router dropped (releases that never came)
    duplicate_releases: int = 0  # releases of slots already gone (ignored)
    late_releases: int = 0  # ... of which slots reconciliation had dropped (corrected too early)
    running: int = 0
    waiting: int = 0
    parked: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    held_device: set[int] = field(default_factory=set)
    held_host: set[int] = field(default_factory=set)
    # hashes of prompts just routed here, held "soon" (before the next poll sees them)
    pending: dict[int, float] = field(default_factory=dict)
    incarnation: str = ""
    node_id: str = ""  # the Ray node the worker's current incarnation runs on
    devices: list[str] = field(default_factory=list)  # one per tensor-parallel rank
    runtime: dict[str, str] = field(default_factory=dict)  # attention, linears, CUDA graphs
    streams: list[dict[str, Any]] = field(default_factory=list)  # its streams, last poll
    # (when, seconds) of its recent first tokens, on the router's clock (autoscaling's TTFT)
    ttft_recent: list[tuple[float, float]] = field(default_factory=list)
    restarts: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    # LoRA adapters: loaded here, in a device slot, in the host-memory cache (last poll)
    loras: set[str] = field(default_factory=set)
    lora_device: set[str] = field(default_factory=set)
    lora_host: set[str] = field(default_factory=set)

    @property
    def load(self) -> int:
        return self.inflight

    def holds(self, h: int) -> bool:
        return h in self.held_device or h in self.held_host or h in self.pending

    def prefix_match(self, hashes: list[int]) -> int:
        """Leading prompt blocks this worker can serve from its device or host cache."""
        n = 0
        for h in hashes:
            if not self.holds(h):
                break
            n += 1
        return n


@dataclass
class RouteRequest:
    block_hashes: list[int]
    session_worker: int | None = None  # the worker that served this session last
    lora: str | None = None  # the LoRA adapter it names (None: the base model)


@dataclass
class Decision:
    idx: int
    reason: str  # "session", "prefix", "lora_device", "lora_host", "least_loaded", "round_robin"
    matched_blocks: int = 0


class Policy(ABC):
    """A routing policy: a pure choice among the workers with room (plug in a subclass)."""

    name = "base"

    def __init__(self, max_imbalance: int) -> None:
        self.max_imbalance = max_imbalance

    @abstractmethod
    def choose(self, workers: list[WorkerView], req: RouteRequest) -> Decision:
        """Pick one of `workers` (never empty) for `req`."""


class LeastLoaded(Policy):
    """Fewest requests in flight, then most free KV; ties rotate so equal load spreads."""

    name = "least_loaded"

    def __init__(self, max_imbalance: int) -> None:
        super().__init__(max_imbalance)
        self._rr = itertools.count()

    def choose(self, workers: list[WorkerView], req: RouteRequest) -> Decision:
        best = min(w.load for w in workers)
        tied = [w for w in workers if w.load == best]
        most_free = max(w.kv_blocks_free for w in tied)
        tied = [w for w in tied if w.kv_blocks_free == most_free]
        return Decision(tied[next(self._rr) % len(tied)].idx, "least_loaded")


class Affinity(LeastLoaded):
    """Exact KV affinity first (session, then longest held prefix), then a LoRA request's
    adapter (a worker with it in a device slot, then one with it in host memory), all within
    an imbalance bound.

    Affinity only wins while its worker has at most `max_imbalance` more requests in flight
    than the least loaded one, so a hot prefix, session or adapter never piles everything on
    one worker: past the bound the least loaded worker takes the request and loads the
    adapter, and from then on holds it too.
    """

    name = "affinity"

    def choose(self, workers: list[WorkerView], req: RouteRequest) -> Decision:
        floor = min(w.load for w in workers)
        ok = [w for w in workers if w.load - floor <= self.max_imbalance]
        if req.session_worker is not None:
            for w in ok:
                if w.idx == req.session_worker:
                    return Decision(w.idx, "session", w.prefix_match(req.block_hashes))
        if req.block_hashes:
            scored = [(w.prefix_match(req.block_hashes), -w.load, w.idx) for w in ok]
            matched, _, idx = max(scored)
            if matched > 0:
                return Decision(idx, "prefix", matched)
        if req.lora is not None:
            for reason, holds in (("lora_device", "lora_device"), ("lora_host", "lora_host")):
                have = [w for w in ok if req.lora in getattr(w, holds)]
                if have:
                    return Decision(min(have, key=lambda w: (w.load, -w.kv_blocks_free)).idx, reason)
        return super().choose(workers, req)


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, max_imbalance: int) -> None:
        super().__init__(max_imbalance)
        self._rr = itertools.count()

    def choose(self, workers: list[WorkerView], req: RouteRequest) -> Decision:
        return Decision(workers[next(self._rr) % len(workers)].idx, "round_robin")


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Affinity, LeastLoaded, RoundRobin)}


def make_policy(name: str, max_imbalance: int) -> Policy:
    try:
        return POLICIES[name](max_imbalance)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}") from None
