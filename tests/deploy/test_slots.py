"""Slot and Leases: a router slot is released exactly once, whoever releases it first."""

from __future__ import annotations

from typing import Any

from kvserve.deploy.slots import Leases, Slot


class _Calls:
    """Records `.remote(...)` calls of an actor method (the router's, the worker's)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def remote(self, *args: Any) -> None:
        self.calls.append(args)


class _Actor:
    def __init__(self) -> None:
        self.release, self.abort = _Calls(), _Calls()


def _slot(router: _Actor, live: dict, rid: str = "r1", n: int = 0) -> Slot:
    pick = {"idx": 1, "worker_id": "worker-1", "slot_id": f"{rid}@{n}", "epoch": "e"}
    return Slot(router, pick, rid, live)


def test_release_is_idempotent_and_aborts_unfinished_requests():
    router, worker, live = _Actor(), _Actor(), {}
    s = _slot(router, live)
    s.worker = worker
    assert live == {"r1@0": s}
    assert s.release() and not s.release() and not s.release()
    assert router.release.calls == [(1, "r1@0")]
    assert worker.abort.calls == [("r1",)]
    assert live == {}


def test_a_finished_request_is_not_aborted():
    router, worker, live = _Actor(), _Actor(), {}
    s = _slot(router, live)
    s.worker, s.finished = worker, True
    s.release()
    assert router.release.calls == [(1, "r1@0")] and worker.abort.calls == []


def test_leases_release_every_slot_once_and_late_slots_at_once():
    router, live = _Actor(), {}
    leases = Leases()
    a, b = _slot(router, live, "a"), _slot(router, live, "b")
    leases.add(a)
    leases.add(b)
    a.release()  # the stream's own finally came first
    assert leases.close() == 1  # only b was still held
    assert leases.close() == 0
    late = _slot(router, live, "c")
    leases.add(late)  # a pick that returned after the client left
    assert late.released
    assert sorted(c[1] for c in router.release.calls) == ["a@0", "b@0", "c@0"]
    assert live == {}
