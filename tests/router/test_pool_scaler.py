"""The router's `PoolScaler` carrying the policy out, on a stand-in router (its views, states,
mover and `_add_workers`) and a clock of its own: the load it reads, the workers it starts
and the cold starts it reports, the worker it drains, and the bounded queue of requests that
wait while no worker serves. The real router and Ray: tests/deploy/test_autoscaling.py."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any

from kvserve.router.autoscale import AutoscalingConfig
from kvserve.router.metrics import AutoscalerMetrics
from kvserve.router.migration import ParkedStream
from kvserve.router.policy import WorkerView
from kvserve.router.scaler import DEFAULT_START_S, PoolScaler

BLOCKS = 32


class _Metrics(AutoscalerMetrics):
    def __init__(self) -> None:  # no Ray series: record the calls
        self.calls: list[tuple] = []

    def pool(self, desired: int, counts: dict[str, int], queued: int) -> None:
        self.calls.append(("pool", desired, counts["serving"], counts["starting"],
                           counts["draining"], queued))

    def decided(self, direction: str, reason: str) -> None:
        self.calls.append(("decided", direction, reason))

    def started(self, cold_start_s: float, pressure_s: float) -> None:
        self.calls.append(("started", cold_start_s, pressure_s))


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class _Router:
    """What PoolScaler reads of the RouterActor."""

    def __init__(self, n: int) -> None:
        self.views: list[WorkerView] = []
        self.states: list[SimpleNamespace] = []
        self.never_placed: set[int] = set()
        self.cfg = SimpleNamespace(engine={"max_num_seqs": 8})
        self.drains: list[int] = []
        self.mover = SimpleNamespace(drained=set(), draining=set(), parked={},
                                     start_drain=self._start_drain)
        self._add_workers(n)
        for v in self.views:
            self.ready(v.idx)

    def _add_workers(self, k: int) -> list[int]:
        added = []
        for _ in range(k):
            i = len(self.views)
            self.views.append(WorkerView(i, f"worker-{i}"))
            self.states.append(SimpleNamespace(state="starting"))
            added.append(i)
        return added

    def ready(self, i: int) -> None:
        v = self.views[i]
        v.alive, v.kv_blocks_total, v.kv_blocks_free = True, BLOCKS, BLOCKS
        self.states[i].state = "ready"

    def _start_drain(self, idx: int, timeout_s: float) -> asyncio.Future:
        self.drains.append(idx)
        self.mover.draining.add(idx)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result({"drained": True, "moved": 0})
        return fut


def _scaler(n: int, **cfg: Any) -> tuple[PoolScaler, _Router, _Metrics, _Clock]:
    router, metrics, clock = _Router(n), _Metrics(), _Clock()
    c = AutoscalingConfig(enabled=True, **{"min_workers": 1, "max_workers": 3,
                                           "upscale_delay_s": 2, "downscale_delay_s": 5, **cfg})
    c.check()
    return PoolScaler(router, c, metrics, clock), router, metrics, clock


def test_the_load_counts_parked_streams_and_starting_workers():
    s, r, _, clock = _scaler(3)
    r.views[0].kv_blocks_free = 2  # 30 held
    r.views[0].running, r.views[0].waiting = 4, 1
    r.mover.parked = {0: [ParkedStream("a", 1.0, 10), ParkedStream("b", 2.0, 6)]}
    r.views[0].ttft_recent = [(clock.t - 100, 9.0), (clock.t - 1, 0.5)]  # one out of window
    r.views[1].alive, r.states[1].state = False, "waiting for resources: {CPU: 1}"
    r.views[2].alive, r.states[2].state = False, "failed: not placed"  # does not count
    load = s.pool_load()
    assert (load.serving, load.starting, load.draining) == (1, 1, 0)
    assert (load.kv_blocks_used, load.parked_blocks, load.parked) == (30, 16, 2)
    assert load.blocks_per_worker == BLOCKS and load.seqs_per_worker == 8
    assert (load.running, load.waiting, load.ttft_p90_s) == (4, 1, 0.5)
    assert load.kv_use() == 46 / (2 * BLOCKS)  # the starting worker counts as capacity
    r.mover.draining.add(0)  # a draining worker no longer serves
    load = s.pool_load()
    assert (load.serving, load.starting, load.draining) == (0, 1, 1)


def test_pressure_held_for_the_delay_starts_one_worker_and_its_cold_start_is_reported(caplog):
    caplog.set_level(logging.WARNING, logger="kvserve.router.scaler")
    s, r, m, clock = _scaler(1)
    r.views[0].kv_blocks_free, r.views[0].inflight = 0, 6
    r.mover.parked = {0: [ParkedStream("a", 1.0, 12)]}
    assert s.tick() is None  # wanted, not yet for upscale_delay_s
    assert s.info()["pending"] == {"direction": "up", "reason": "kv_pressure", "in_s": 2.0}
    clock.t += 2.5
    d = s.tick()
    assert (d.direction, d.reason, d.current, d.desired) == ("up", "kv_pressure", 1, 2)
    assert len(r.views) == 2 and s.starts[1][1] is d
    assert ("decided", "up", "kv_pressure") in m.calls
    assert "autoscaler: up from 1 to 2 workers (kv_pressure: KV use 1.38 with 1 parked streams " \
        "counted (>= 0.9); 2 workers hold it at 0.7; wanted for 2.5 s)" in caplog.text
    assert m.calls[-1] == ("pool", 2, 1, 1, 0, 0)  # desired 2: one serving, one starting
    clock.t += 2.5
    assert s.tick() is None  # the starting worker is the capacity the load wanted
    assert len(r.views) == 2
    clock.t += 10
    r.ready(1)
    s.worker_ready(1, load_s=8.0)
    (cold,) = s.info()["cold_starts"]
    assert cold == {"worker_id": "worker-1", "reason": "kv_pressure", "cold_start_s": 12.5,
                    "pressure_to_serving_s": 15.0, "load_s": 8.0}
    assert m.calls[-1] == ("started", 12.5, 15.0)
    assert "worker-1 serves 12.5 s after the decision (model load 8.0 s), 15.0 s after the " \
        "load first wanted it" in caplog.text
    assert s.info()["decisions"] == {"up:kv_pressure": 1}


def test_the_least_loaded_worker_is_drained_one_at_a_time():
    async def run() -> tuple[PoolScaler, _Router, _Metrics]:
        s, r, m, clock = _scaler(3, min_workers=1)
        for v, inflight in zip(r.views, (1, 0, 0), strict=True):
            v.inflight, v.running = inflight, inflight
        r.views[0].kv_blocks_free = BLOCKS - 4
        assert s.tick() is None
        clock.t += 6
        d = s.tick()
        assert (d.direction, d.reason, d.desired) == ("down", "low_load", 2)
        await asyncio.sleep(0)
        # workers 1 and 2 tie (idle): the newer goes, worker-0 and worker-1 stay
        assert r.drains == [2]
        clock.t += 60
        assert s.tick() is None  # nothing more while one drains
        r.mover.draining.discard(2)
        r.mover.drained.add(2)
        return s, r, m

    s, r, m = asyncio.run(run())
    assert r.drains == [2] and s.info()["decisions"] == {"down:low_load": 1}
    assert s.info()["draining_workers"] == 0 and s.info()["serving_workers"] == 2


def test_a_request_with_no_worker_starts_one_and_waits_for_it():
    async def run() -> tuple[PoolScaler, _Router, Any]:
        s, r, m, clock = _scaler(1, min_workers=0, max_workers=1)
        r.mover.drained.add(0)  # scaled to zero
        r.views[0].alive = False
        waiter = asyncio.create_task(s.wait_for_worker())
        await asyncio.sleep(0.05)
        assert s.queued == 1 and len(r.views) == 2  # started at once: no upscale delay
        assert s.info()["last_decisions"][-1]["reason"] == "no_worker"
        r.ready(1)
        s.worker_ready(1, load_s=3.0)
        return s, r, await asyncio.wait_for(waiter, 5)

    s, r, answer = asyncio.run(run())
    assert answer is None and s.queued == 0  # it goes to worker-1
    assert s.info()["cold_starts"][0]["reason"] == "no_worker"


def test_the_queue_is_bounded_in_size_and_time_and_names_a_retry_time():
    async def run() -> tuple[Any, Any, int]:
        s, r, m, clock = _scaler(1, min_workers=0, max_workers=1, max_queued_requests=1,
                                 queue_timeout_s=0.3)
        r.mover.drained.add(0)
        r.views[0].alive = False
        s.clock = s.policy.clock = time.monotonic  # the wait is real
        first = asyncio.create_task(s.wait_for_worker())
        await asyncio.sleep(0.05)
        full = await s.wait_for_worker()  # the one place is taken: refused at once
        return full, await first, len(r.views)

    full, timed_out, workers = asyncio.run(run())
    assert workers == 2  # one start, for the first request
    assert full["error"] == timed_out["error"] == "unavailable"
    assert "1 requests already wait for a worker to start (max_queued_requests)" in \
        full["message"]
    assert "no worker became ready within 0.3 s (queue_timeout_s); worker-1 is starting" in \
        timed_out["message"]
    # no start measured yet: the assumed start time, less what the start has run
    assert 1 <= timed_out["retry_after"] <= DEFAULT_START_S
    assert timed_out["message"].endswith(f"retry in about {timed_out['retry_after']} s")
