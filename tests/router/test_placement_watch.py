"""The router's watch over workers Ray has not placed (router/placement.py), on a fake of
Ray's answers and a fake clock: which wait for resources, which are only starting, and
which failed past the timeout. Against a real Ray: tests/deploy/test_placement_ray.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.router.placement import PlacementWatch


@dataclass
class FakeRay:
    placed: set[str] = field(default_factory=set)  # actor ids with a process
    pending_groups: set[str] = field(default_factory=set)
    queued: list[tuple[dict[str, float], int]] = field(default_factory=list)

    def actor_placed(self, actor_id: str) -> bool:
        return actor_id in self.placed

    def group_pending(self, group: str) -> bool:
        return group in self.pending_groups

    free: list[dict[str, float]] | None = None  # each node's free resources (None: room)

    def queued_shapes(self) -> list[tuple[dict[str, float], int]]:
        return self.queued

    def fits_anywhere(self, shape: dict[str, float]) -> bool:
        return self.free is None or any(
            all(f.get(k, 0.0) >= v for k, v in shape.items()) for f in self.free)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _watch(ray: FakeRay, clock: Clock, timeout_s: float = 60.0) -> PlacementWatch:
    w = PlacementWatch(timeout_s, ray, clock)
    for i in range(3):
        w.track(i, f"a{i}", {"CPU": 1.0}, None)
    return w


def test_the_last_workers_of_a_queued_shape_wait_the_others_start():
    ray, clock = FakeRay(placed={"a0"}), Clock()
    w = _watch(ray, clock)
    # a1 and a2 have no process yet; Ray queues one {CPU: 1} request for lack of room:
    # it grants a shape's requests in order, so the last worker is the one that waits
    ray.queued = [({"CPU": 1.0}, 1), ({"GPU": 1.0}, 3)]
    got = w.check()
    assert {i: v.kind for i, v in got.items()} == {0: "placed", 1: "starting", 2: "waiting"}
    assert got[2].state == "waiting for resources: {CPU: 1}"
    assert got[1].state == "starting"
    # placed workers are no longer watched; the others are
    assert set(w.check()) == {1, 2}
    ray.placed |= {"a1", "a2"}
    ray.queued = []
    assert {i: v.kind for i, v in w.check().items()} == {1: "placed", 2: "placed"}
    assert not w.watching() and w.check() == {}


def test_a_worker_unplaced_past_the_timeout_fails_with_what_it_waited_for():
    ray, clock = FakeRay(placed={"a0"}, queued=[({"CPU": 1.0}, 2)]), Clock()
    w = _watch(ray, clock, timeout_s=30)
    clock.t += 29.9
    assert {v.kind for i, v in w.check().items() if i} == {"waiting"}
    clock.t += 0.1
    got = w.check()
    assert got[1].kind == got[2].kind == "failed"
    assert got[2].state == ("failed: not placed within 30 s (placement_timeout_s): waiting for "
                            "resources: {CPU: 1}; no node had them free and none was added")
    assert not w.watching()  # failed ones are no longer watched


def test_a_worker_that_never_got_a_process_without_queued_demand_fails_as_not_started():
    ray, clock = FakeRay(placed={"a0", "a1"}), Clock()  # a2: no process, nothing queued
    w = _watch(ray, clock, timeout_s=5)
    assert w.check()[2].kind == "starting"
    clock.t += 5
    assert w.check()[2].state == ("failed: not placed within 5 s (placement_timeout_s): Ray did "
                                  "not start it")


def test_a_tensor_parallel_worker_waits_while_its_group_is_pending():
    ray, clock = FakeRay(pending_groups={"pg1"}), Clock()
    w = PlacementWatch(60, ray, clock)
    w.track(0, "a0", {"CPU": 1.0, "GPU": 4.0}, "pg0")
    w.track(1, "a1", {"CPU": 1.0, "GPU": 4.0}, "pg1")
    got = w.check()
    assert got[0].kind == "placed"  # its group is created: the actor runs in it
    assert got[1].state == "waiting for resources: {CPU: 1, GPU: 4} on one node"
    w.forget(1)
    assert not w.watching()


def test_shapes_compare_as_ray_counts_them():
    ray, clock = FakeRay(queued=[({"CPU": 0.50000001, "GPU": 0.25, "memory": 0.0}, 1)]), Clock()
    w = PlacementWatch(60, ray, clock)
    w.track(0, "a0", {"CPU": 0.5, "GPU": 0.25}, None)
    assert w.check()[0].kind == "waiting"


def test_with_no_node_free_every_unplaced_worker_waits_whatever_ray_reports_queued():
    """Ray's report of queued requests leaves some out at times: a worker without a process
    whose shape no node has free is waiting, not starting."""
    ray, clock = FakeRay(placed={"a0"}), Clock()
    w = _watch(ray, clock)
    ray.free = [{"CPU": 0.5, "memory": 1e9}]  # less than a worker's {CPU: 1} anywhere
    got = w.check()
    assert {i: v.kind for i, v in got.items()} == {0: "placed", 1: "waiting", 2: "waiting"}
    assert got[1].state == "waiting for resources: {CPU: 1}"
    ray.free = [{"CPU": 0.5}, {"CPU": 1.0}]  # room on a node: they may be starting there
    assert {i: v.kind for i, v in w.check().items()} == {1: "starting", 2: "starting"}
