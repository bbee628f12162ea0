"""The migration planner on hand-built worker views (pure, no Ray)."""

from __future__ import annotations

from kvserve.router.migration import (
    MigrationConfig,
    ParkedStream,
    WorkerState,
    drain_target,
    plan_moves,
)

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


def test_drain_target_is_the_least_loaded_live_worker():
    ws = [idle(0), idle(1, 10), idle(2, 90), WorkerState(3, alive=False)]
    assert drain_target(ws, 0, {1: 0, 2: 0}) == 2
    assert drain_target(ws, 0, {1: 0, 2: 3}) == 1
    assert drain_target([idle(0), WorkerState(1, draining=True)], 0, {}) is None
