"""Which of the router's new workers Ray has not placed yet, what they wait for, and which
waited too long.

A worker actor that no node has room for is queued by Ray with no process: it cannot tell
anyone. The router asks Ray instead, about each worker it started that has not reported:

- a tensor-parallel worker waits while its placement group is PENDING (no node has the
  whole bundle free);
- a plain worker has no process yet (Ray's actor table: no pid), and the raylets report
  requests of its shape queued for lack of resources (the demand the autoscaler reads).
  Ray grants queued requests of one shape in order, so when fewer are queued than such
  workers lack a process, the last ones are those that wait; the others are starting.

Such a worker is "waiting for resources: {CPU: 1}" until it is placed. One still unplaced
`timeout_s` after its start has failed: the router stops it, so that it takes no node later,
and reports why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvserve.workers.placement import format_resources

WAITING = "waiting for resources: "
SHAPE_EPS = 1e-6


class PlacementProbe(Protocol):
    """What Ray says about placement (RayProbe; a fake in unit tests)."""

    def actor_placed(self, actor_id: str) -> bool: ...

    def group_pending(self, group: Any) -> bool: ...

    def queued_shapes(self) -> Sequence[tuple[Mapping[str, float], int]]: ...

    def fits_anywhere(self, shape: Mapping[str, float]) -> bool: ...


@dataclass
class Tracked:
    idx: int
    actor_id: str
    bundle: dict[str, float]
    group: Any  # the tensor-parallel worker's placement group, else None
    since: float


@dataclass(frozen=True)
class Verdict:
    """`placed`, `starting` (no process yet, not known to wait), `waiting` or `failed`, and
    the state shown for it."""

    kind: str
    state: str = ""


class PlacementWatch:
    def __init__(self, timeout_s: float, probe: PlacementProbe | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.probe = probe
        self.clock = clock
        self._tracked: dict[int, Tracked] = {}

    def track(self, idx: int, actor_id: str, bundle: Mapping[str, float], group: Any) -> None:
        """A worker just started: watched until it is placed."""
        self._tracked[idx] = Tracked(idx, actor_id, dict(bundle), group, self.clock())

    def forget(self, idx: int) -> None:
        self._tracked.pop(idx, None)

    def watching(self) -> bool:
        return bool(self._tracked)

    def check(self) -> dict[int, Verdict]:
        """Each watched worker's verdict (blocking Ray calls: run it off the event loop).
        Placed and failed workers are no longer watched."""
        probe = self.probe or RayProbe()
        now = self.clock()
        unplaced: list[Tracked] = []
        out: dict[int, Verdict] = {}
        for t in sorted(self._tracked.values(), key=lambda t: t.idx):
            placed = (not probe.group_pending(t.group) if t.group is not None
                      else probe.actor_placed(t.actor_id))
            if placed:
                out[t.idx] = Verdict("placed")
            else:
                unplaced.append(t)
        waiting = {t.idx for t in unplaced if t.group is not None}
        plain = [t for t in unplaced if t.group is None]
        if plain:
            queued = list(probe.queued_shapes())
            for shape in {_key(t.bundle) for t in plain}:
                same = [t for t in plain if _key(t.bundle) == shape]
                n = sum(c for s, c in queued if _key(s) == shape)
                if n < len(same) and not probe.fits_anywhere(same[0].bundle):
                    # no node has the shape free: none of them can be starting (Ray's report
                    # of queued requests leaves some out at times, and lags)
                    n = len(same)
                waiting |= {t.idx for t in same[len(same) - min(n, len(same)):]}
        for t in unplaced:
            what = WAITING + format_resources(t.bundle) + (" on one node" if t.group else "")
            if now - t.since >= self.timeout_s:
                why = (f"{what}; no node had them free and none was added" if t.idx in waiting
                       else "Ray did not start it")
                out[t.idx] = Verdict("failed", f"failed: not placed within {self.timeout_s:g} s "
                                               f"(placement_timeout_s): {why}")
            elif t.idx in waiting:
                out[t.idx] = Verdict("waiting", what)
            else:
                out[t.idx] = Verdict("starting", "starting")
        for idx, v in out.items():
            if v.kind in ("placed", "failed"):
                self.forget(idx)
        return out


def _key(shape: Mapping[str, float]) -> tuple[tuple[str, int], ...]:
    """A resource shape compared as Ray does (units of 1e-4), zero amounts left out."""
    return tuple(sorted((k, round(v * 10_000)) for k, v in shape.items() if v > SHAPE_EPS))


class RayProbe:
    """Ray's own view, from the GCS (no dashboard needed)."""

    def actor_placed(self, actor_id: str) -> bool:
        import ray

        info = ray._private.state.state.actor_table(actor_id)
        if not info:
            return False
        # a process is given to it once a node has granted its resources
        return info.get("State") != "PENDING_CREATION" or bool(info.get("Pid"))

    def group_pending(self, group: Any) -> bool:
        from ray.util.placement_group import placement_group_table

        return placement_group_table(group).get("state") == "PENDING"

    def __init__(self) -> None:
        self._free: list[dict[str, float]] = []  # each live node's free resources

    def queued_shapes(self) -> list[tuple[dict[str, float], int]]:
        import ray
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        state = get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)
        # (node status: 1 running, 3 idle; a resource with nothing free is left out)
        self._free = [dict(n.available_resources) for n in state.node_states
                      if n.status in (1, 3)]
        return [(dict(r.request.resources_bundle), r.count)
                for r in state.pending_resource_requests]

    def fits_anywhere(self, shape: Mapping[str, float]) -> bool:
        """Whether some live node had `shape` free at the last `queued_shapes`."""
        return any(all(free.get(k, 0.0) + SHAPE_EPS >= v for k, v in shape.items())
                   for free in self._free)
