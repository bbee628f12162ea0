"""The migration planner on hand-built worker views (pure, no Ray); the mover's room
bookkeeping between polls, on fake worker handles; and the parked ages the workers report."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from kvserve.router.migration import (
    MigrationConfig,
    Move,
    ParkedStream,
    RunningStream,
    WorkerState,
    drain_target,
    plan_moves,
    plan_rebalance,
    pressured,
)
from kvserve.router.mover import StreamMover
from kvserve.router.policy import WorkerView
from kvserve.workers.engine.migration import ParkedTracker

CFG = MigrationConfig(park_threshold_s=1.0, max_inflight=2, min_interval_s=10.0, headroom=0.1)


def full(idx: int, *parked: tuple[str, float, int]) -> WorkerState:
    return WorkerState(idx, kv_blocks_free=0, kv_blocks_total=100,
                       parked=[ParkedStream(r, s, b) for r, s, b in parked])


def idle(idx: int, free: int = 100) -> WorkerState:
    return WorkerState(idx, kv_blocks_free=free, kv_blocks_total=100)


def test_oldest_parked_streams_move_to_the_roomiest_worker():
    ws = [full(0, ("young", 0.5, 5), ("old", 9.0, 5), ("mid", 3.0, 5)), idle(1, 40), idle(2, 60)]
    moves = plan_moves(ws, CFG, set(), {}, now=100.0)
    # two at most in flight; the oldest first; a stream parked under the threshold stays
    assert [(m.request_id, m.src, m.dst) for m in moves] == [("old", 0, 2), ("mid", 0, 2)]


def test_room_counts_headroom_and_planned_moves():
    ws = [full(0, ("a", 5.0, 30), ("b", 4.0, 30)), idle(1, 45)]
    # 45 free minus 10 kept: one 30-block stream fits, the second does not
    assert [m.request_id for m in plan_moves(ws, CFG, set(), {}, 0.0)] == ["a"]
    assert plan_moves([full(0, ("a", 5.0, 36)), idle(1, 45)], CFG, set(), {}, 0.0) == []


def test_bounds_in_flight_interval_and_targets():
    ws = [full(0, ("a", 5.0, 5), ("b", 5.0, 5)), idle(1)]
    assert plan_moves(ws, CFG, {"x", "y"}, {}, 0.0) == []  # N moves already in flight
    only_b = plan_moves(ws, CFG, set(), {"a": 95.0}, now=100.0)  # a moved 5 s ago
    assert [m.request_id for m in only_b] == ["b"]
    # no target: a worker that parks, waits, drains or is dead has no room to give
    busy = [full(0, ("a", 5.0, 5)), full(1, ("z", 0.1, 1)),
            WorkerState(2, waiting=1, kv_blocks_free=100, kv_blocks_total=100),
            WorkerState(3, draining=True, kv_blocks_free=100, kv_blocks_total=100),
            WorkerState(4, alive=False, kv_blocks_free=100, kv_blocks_total=100)]
    assert plan_moves(busy, CFG, set(), {}, 0.0) == []
    off = MigrationConfig(enabled=False)
    assert plan_moves(ws, off, set(), {}, 0.0) == []


def busy(idx: int, free: int, *running: tuple[str, int], parked: int = 1,
         waiting: int = 0) -> WorkerState:
    """A worker with `free` of 100 blocks free, running streams (id, blocks), parking."""
    return WorkerState(idx, waiting=waiting, kv_blocks_free=free, kv_blocks_total=100,
                       parked=[ParkedStream(f"p{idx}{i}", 0.1, 5) for i in range(parked)],
                       running=[RunningStream(r, b * 16, b) for r, b in running])


REB = MigrationConfig(max_inflight=4, min_interval_s=10.0, headroom=0.1, pressure_use=0.9,
                      growth_tokens=64)  # 4 blocks of growth


def test_a_pressured_worker_moves_its_largest_fitting_running_stream_live():
    ws = [busy(0, 2, ("small", 10), ("big", 40), ("huge", 60)), idle(1, 60), idle(2, 30)]
    assert pressured(ws[0], REB) and not pressured(ws[1], REB)
    # huge (60 + 4) fits nowhere with 10 blocks kept free; big (44) fits worker 1
    assert plan_rebalance(ws, REB, set(), {}, 0.0) == [Move("big", 0, 1, 44)]


def test_rebalance_only_under_pressure_and_into_room():
    # not pressured: nothing parked or waiting, or the KV not full enough
    assert plan_rebalance([busy(0, 2, ("a", 10), parked=0), idle(1)], REB, set(), {}, 0.0) == []
    assert plan_rebalance([busy(0, 30, ("a", 10)), idle(1)], REB, set(), {}, 0.0) == []
    waiting = busy(0, 5, ("a", 10), parked=0, waiting=3)
    assert [m.request_id for m in plan_rebalance([waiting, idle(1)], REB, set(), {}, 0.0)] == ["a"]
    # no target: others park, wait, are pressured themselves, drain or are dead
    others = [busy(1, 90, parked=1), WorkerState(2, waiting=1, kv_blocks_free=90,
                                                 kv_blocks_total=100),
              WorkerState(3, draining=True, kv_blocks_free=100, kv_blocks_total=100),
              WorkerState(4, alive=False, kv_blocks_free=100, kv_blocks_total=100)]
    assert plan_rebalance([busy(0, 2, ("a", 10)), *others], REB, set(), {}, 0.0) == []
    # the target's room counts moves already headed there
    assert plan_rebalance([busy(0, 2, ("a", 10)), idle(1, 30)], REB, set(), {}, 0.0,
                          reserved={1: 10}) == []
    assert plan_rebalance([busy(0, 2, ("a", 10)), idle(1)],
                          MigrationConfig(live=False), set(), {}, 0.0) == []


def test_rebalance_cools_down_and_moves_one_stream_per_worker_at_a_time():
    ws = [busy(0, 2, ("a", 10), ("b", 8)), busy(1, 1, ("c", 10)), idle(2), idle(3)]
    first = plan_rebalance(ws, REB, set(), {}, 0.0)
    assert sorted((m.request_id, m.src) for m in first) == [("a", 0), ("c", 1)]
    assert {m.dst for m in first} == {2, 3}  # each to the roomiest left
    # a move under way out of worker 0: nothing else leaves it; c moved a moment ago stays
    assert plan_rebalance(ws, REB, {"a"}, {"c": 95.0}, now=100.0) == []
    assert [m.request_id for m in plan_rebalance(ws, REB, set(), {"a": 95.0}, 100.0)
            if m.src == 0] == ["b"]


def test_drain_target_is_the_least_loaded_live_worker():
    ws = [idle(0), idle(1, 10), idle(2, 90), WorkerState(3, alive=False)]
    assert drain_target(ws, 0, {1: 0, 2: 0}) == 2
    assert drain_target(ws, 0, {1: 0, 2: 3}) == 1
    assert drain_target([idle(0), WorkerState(1, draining=True)], 0, {}) is None


def test_moves_under_way_take_their_targets_room():
    ws = [full(0, ("a", 5.0, 5), ("b", 4.0, 5)), idle(1, 45)]
    # 45 free, 10 kept, 30 already headed there: room for one 5-block stream, not two
    assert [m.request_id for m in plan_moves(ws, CFG, set(), {}, 0.0, {1: 30})] == ["a"]
    assert plan_moves(ws, CFG, set(), {}, 0.0, {1: 31}) == []
    assert plan_moves(ws, CFG, set(), {}, 0.0, {0: 99})[0] == Move("a", 0, 1, 5)


# ---- the mover's bookkeeping between polls -----------------------------------------------------
class _Call:
    def __init__(self, f: Callable[..., Any]) -> None:
        self.remote = f


def _handle(imports: list[str]) -> SimpleNamespace:
    async def value(v: Any) -> Any:
        return v

    def import_stream(data: bytes) -> Any:
        imports.append(data.decode())
        return value({"request_id": data.decode()})

    return SimpleNamespace(
        export_stream=_Call(lambda rid: (value({"bytes": 10}), rid.encode())),
        import_stream=_Call(import_stream),
        hand_over=_Call(lambda rid, dst: value(True)))


def _load(parked: list[tuple[str, float, int]], free: int) -> dict[str, Any]:
    return {"parked_streams": [{"request_id": r, "parked_s": s, "blocks_needed": b,
                                "kv_bytes": 0} for r, s, b in parked]}


def test_a_poll_that_missed_landed_moves_does_not_overfill_their_target():
    """Two streams moved to worker 1 while its poll was on the way: the next round counts
    their blocks against worker 1's room until a poll sent after they landed sees them."""
    imports: list[str] = []
    views = [WorkerView(0, "worker-0", alive=True, kv_blocks_free=0, kv_blocks_total=100),
             WorkerView(1, "worker-1", alive=True, kv_blocks_free=60, kv_blocks_total=100)]
    cfg = MigrationConfig(park_threshold_s=1.0, max_inflight=4, min_interval_s=10.0)
    mover = StreamMover(cfg, [_handle([]), _handle(imports)], views, OrderedDict(), 10)

    async def run() -> None:
        mover.observe(0, _load([("a", 5.0, 25), ("b", 4.0, 25), ("c", 3.0, 25)], 0), 0.0)
        mover.observe(1, _load([], 60), 0.0)
        mover.tick()  # 60 free, 10 kept: a and b fit, c does not
        assert sorted(mover.moving) == ["a", "b"] and mover.reserved() == {1: 50}
        await asyncio.gather(*mover._tasks)
        assert sorted(imports) == ["a", "b"] and not mover.moving
        # a poll sent before they landed still shows worker 1 empty, worker 0 with c parked
        mover.observe(0, _load([("c", 9.0, 25)], 0), sent_at=0.0)
        mover.observe(1, _load([], 60), sent_at=0.0)
        mover.tick()
        assert not mover.moving and mover.reserved() == {1: 50}  # c still has no room there
        views[1].kv_blocks_free = 10  # the next poll sees them there
        mover.observe(1, _load([], 10), sent_at=time.monotonic())
        assert mover.reserved() == {}
        mover.tick()
        assert not mover.moving  # and still no room for c

    asyncio.run(run())


def test_a_failed_move_gives_its_room_back():
    views = [WorkerView(0, "worker-0", alive=True, kv_blocks_total=100),
             WorkerView(1, "worker-1", alive=True, kv_blocks_free=60, kv_blocks_total=100)]
    target = _handle([])

    async def refuse(data: bytes) -> dict[str, Any]:
        return {"error": "refused"}

    target.import_stream = _Call(refuse)
    source = _handle([])
    source.import_stream = _Call(lambda data: _async({"request_id": "a"}))  # taken back
    source.abort = _Call(lambda rid: None)
    mover = StreamMover(MigrationConfig(park_threshold_s=1.0), [source, target], views,
                        OrderedDict(), 10)

    async def run() -> None:
        mover.observe(0, _load([("a", 5.0, 25)], 0), 0.0)
        mover.tick()
        assert mover.reserved() == {1: 25}
        await asyncio.gather(*mover._tasks)
        assert mover.reserved() == {}

    asyncio.run(run())


async def _async(v: Any) -> Any:
    return v


# ---- how long a stream has been parked (the planner's input, from the worker) ------------------
class _Engine:
    """What ParkedTracker reads of an engine: the parked queue, the unfinished requests."""

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(parked=[])
        self.seqs: dict[str, Any] = {}
        self.runner = SimpleNamespace(cache=SimpleNamespace(bytes_per_block=100))
        self.kv = SimpleNamespace(blocks_needed=lambda n: -(-n // 16))

    def add(self, rid: str) -> SimpleNamespace:
        s = SimpleNamespace(request_id=rid, parked_kv=None, all_ids=[1] * 40)
        self.seqs[rid] = s
        return s


def test_a_stream_parked_in_short_spells_reaches_the_threshold():
    """Restored and evicted again between polls, a stream keeps the time it spent parked:
    parked 0.8 s of every second, it moves, though no spell reaches the threshold."""
    eng, t = _Engine(), ParkedTracker()
    s = eng.add("r")
    ages = []
    for k in range(3):  # parked for 0.8 s, then running for 0.2 s
        eng.scheduler.parked = [s]
        t.view(eng, now=k + 0.0)
        ages.append(t.view(eng, now=k + 0.8)[0]["parked_s"])
        eng.scheduler.parked = []
        t.view(eng, now=k + 1.0)
    assert ages == pytest.approx([0.8, 1.6, 2.4])
    eng.scheduler.parked = [s]
    view = t.view(eng, now=3.0)
    assert view[0]["parked_s"] == pytest.approx(2.4) and view[0]["blocks_needed"] == 3
    ws = [WorkerState(0, kv_blocks_total=100, parked=[
        ParkedStream(p["request_id"], p["parked_s"], p["blocks_needed"]) for p in view]), idle(1)]
    assert [m.request_id for m in plan_moves(ws, CFG, set(), {}, 100.0)] == ["r"]
    # ages are read when asked, not when the last step ended
    assert t.streams(now=5.0)[0]["parked_s"] == pytest.approx(4.4)
    # a finished stream's time is forgotten; a new one starts from zero
    del eng.seqs["r"]
    eng.scheduler.parked = []
    t.view(eng, now=6.0)
    assert t.before == {} and t.since == {}
    s2 = eng.add("r2")
    eng.scheduler.parked = [s2]
    assert t.view(eng, now=7.0)[0]["parked_s"] == 0.0


def test_the_interval_runs_from_the_end_of_a_failed_move():
    """A move that fails after a long import (its timeout longer than the interval) leaves
    the stream at its source: the interval counts from that failure, so the next round does
    not send it straight off again."""
    views = [WorkerView(0, "worker-0", alive=True, kv_blocks_total=100),
             WorkerView(1, "worker-1", alive=True, kv_blocks_free=60, kv_blocks_total=100)]
    target = _handle([])

    async def slow_refusal(data: bytes) -> dict[str, Any]:
        await asyncio.sleep(0.3)
        return {"error": "refused"}

    target.import_stream = _Call(slow_refusal)
    source = _handle([])
    source.import_stream = _Call(lambda data: _async({"request_id": "a"}))  # taken back
    mover = StreamMover(MigrationConfig(park_threshold_s=1.0), [source, target], views,
                        OrderedDict(), 10)

    async def run() -> float:
        mover.observe(0, _load([("a", 5.0, 25)], 0), 0.0)
        mover.tick()
        started = time.monotonic()  # the move itself starts after this
        await asyncio.gather(*mover._tasks)
        return started

    started = asyncio.run(run())
    assert mover.last_moved["a"] >= started + 0.3  # when it failed, not when it started
    ws = [full(0, ("a", 5.0, 25)), idle(1)]
    cfg = mover.cfg
    assert plan_moves(ws, cfg, set(), mover.last_moved, mover.last_moved["a"] + 1.0) == []
    assert plan_moves(ws, cfg, set(), mover.last_moved,
                      mover.last_moved["a"] + cfg.min_interval_s)[0].request_id == "a"
