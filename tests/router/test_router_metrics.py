"""The router's metrics: a prefix decision is device or host affinity by where it lives; the
mover records stream moves, failed moves and drain states per worker."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from kvserve.router.metrics import DRAIN_STATES, POLICY_KINDS, MigrationMetrics, decision_kind
from kvserve.router.migration import MigrationConfig
from kvserve.router.mover import StreamMover
from kvserve.router.policy import POLICIES, Decision, WorkerView


def test_prefix_decisions_split_by_tier():
    w = WorkerView(0, "worker-0", held_device={1, 2}, held_host={3}, pending={4: 0.0})
    assert decision_kind(Decision(0, "prefix", 2), w, [1, 2, 3]) == "device_affinity"
    assert decision_kind(Decision(0, "prefix", 3), w, [1, 2, 3]) == "host_affinity"
    assert decision_kind(Decision(0, "prefix", 1), w, [4, 9]) == "device_affinity"  # just routed


def test_other_decisions_keep_their_reason():
    w = WorkerView(0, "worker-0")
    for reason in ("session", "least_loaded", "round_robin"):
        assert decision_kind(Decision(0, reason), w, [1]) == reason


def test_every_policy_has_its_kinds():
    assert set(POLICY_KINDS) == set(POLICIES)


class _Call:
    """A fake actor method: `.remote(...)` returns what the function returns."""

    def __init__(self, f: Callable[..., Any]) -> None:
        self.remote = f


class _Spy(MigrationMetrics):
    def __init__(self) -> None:  # no Ray series: record the calls
        self.calls: list[tuple] = []

    def moved(self, src: str, dst: str, nbytes: int) -> None:
        self.calls.append(("moved", src, dst, nbytes))

    def failed(self, dst: str) -> None:
        self.calls.append(("failed", dst))

    def drain_state(self, worker: str, state: str) -> None:
        self.calls.append(("drain", worker, state))

    def stream_move(self, reason: str, method: str, outcome: str, res: dict) -> None:
        self.calls.append(("move", reason, method, outcome))


async def _value(v: Any) -> Any:
    return v


def _worker(import_result: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(
        export_stream=_Call(lambda rid: (_value({"bytes": 1234}), b"x" * 1234)),
        import_stream=_Call(lambda data: _value(import_result)),
        hand_over=_Call(lambda rid, dst: _value(True)),
        unfinished_ids=_Call(lambda: _value(["r"])),
        abort=_Call(lambda rid: _value(True)))


def _mover(results: list[dict[str, Any]], spy: _Spy) -> StreamMover:
    views = [WorkerView(i, f"worker-{i}", alive=i == 0) for i in range(len(results))]
    return StreamMover(MigrationConfig(), [_worker(r) for r in results], views, OrderedDict(),
                       100, spy)


def test_moves_and_failures_are_recorded_per_worker():
    spy = _Spy()
    ok = _mover([{"request_id": "r"}, {"request_id": "r"}], spy)
    assert asyncio.run(ok.move("r", 0, 1, "operator", "snapshot"))["bytes"] == 1234
    bad = _mover([{"request_id": "r"}, {"error": "refused"}], spy)
    assert "error" in asyncio.run(bad.move("r", 0, 1, "drain", "snapshot"))
    assert spy.calls == [("moved", "worker-0", "worker-1", 1234),
                         ("move", "operator", "snapshot", "moved"), ("failed", "worker-1"),
                         ("move", "drain", "snapshot", "failed")]
    assert ok.stats(1)["migration_bytes_in"] == 1234 and bad.stats(1)["migration_failures"] == 1


def test_a_drain_with_nowhere_to_go_ends_serving_again():
    spy = _Spy()
    mover = _mover([{}, {}], spy)  # worker 1 is down: worker 0's stream has nowhere to go
    res = asyncio.run(mover.drain(0, 5.0))
    assert not res["drained"] and "no other worker" in res["error"]
    assert spy.calls == [("drain", "worker-0", "draining"), ("drain", "worker-0", "serving")]
    assert mover.stats(0)["draining"] == 0 and DRAIN_STATES == {
        "serving": 0, "draining": 1, "drained": 2}


def test_an_import_that_lands_after_the_timeout_is_aborted_on_its_target():
    spy, aborted = _Spy(), []

    async def slow_import(data: bytes) -> dict[str, Any]:
        await asyncio.sleep(0.3)  # longer than the move waits
        return {"request_id": "r"}

    async def run() -> dict[str, Any]:
        mover = _mover([{"request_id": "r"}, {}], spy)
        mover.cfg.import_timeout_s = 0.1
        mover.handles[1].import_stream = _Call(slow_import)
        mover.handles[1].abort = _Call(lambda rid: aborted.append((1, rid)))
        res = await mover.move("r", 0, 1, "parked", "snapshot")
        assert not aborted  # the import has not answered yet
        await asyncio.sleep(0.5)
        return res

    res = asyncio.run(run())
    assert res["returned"] and "Timeout" in res["error"]
    assert aborted == [(1, "r")]
    assert spy.calls == [("failed", "worker-1"), ("move", "parked", "snapshot", "failed")]
