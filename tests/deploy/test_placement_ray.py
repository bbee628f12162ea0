"""Workers Ray cannot place, on a real Ray: a local Ray that can never hold them fails before
any model loads (`kvserve serve` itself, and the check on the session's Ray); a worker that
waits for room is shown as waiting while the service serves with the others, and joins when
the room is freed; one that waits past the placement timeout is stopped and reported failed.
The router and its workers here are the test's own, beside the session's app (their CPUs
are the session Ray's: 4, of which the app's two workers hold 2). With an autoscaler that
adds a node: tests/deploy/test_placement_autoscaling.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from serve_fixtures import ENGINE
from serve_process import ServeProcess

from kvserve.deploy.config import ServeConfig
from kvserve.deploy.service import Service
from kvserve.errors import StartupError
from kvserve.router.lifecycle import get_or_create_router, kill_router

WAIT_S = 300.0  # bound on every wait for an observed event (a loaded machine is slow)
WAITING_ROUTER = "kvserve-router-waits"
UNPLACED_ROUTER = "kvserve-router-unplaced"


def _until(what: str, check: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.2)
    return got


@pytest.mark.slow  # a Ray of its own: 10-40 s on the 2-core host
def test_serve_on_a_two_cpu_ray_refuses_three_one_cpu_workers_before_loading():
    """`kvserve serve --workers 3` (one CPU each) on a local Ray of 2 CPUs: it stops at once,
    before the model loads, naming the numbers and the ways out, and leaves nothing."""
    sp = ServeProcess(workers=3, env={"RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 2})})
    try:
        sp.signalled_at = time.monotonic()  # (no signal: the deadline counts from here)
        rc = sp.wait_exit(WAIT_S)
    finally:
        sp.kill()
    out = "\n".join(sp.lines)
    assert rc == 2, sp.output
    assert ("kvserve: error: the workers cannot be placed, and this Ray cannot add nodes: 3 workers "
            "need {CPU: 1} each, and the nodes hold 2 at once; the nodes have 127.0.0.1 "
            "{CPU: 2}. Ways out: --workers 2; --cpus-per-worker 0.66; more or larger nodes"
            in out), sp.output
    assert "deploying" not in out and "loading" not in out, sp.output  # no model loaded
    assert not sp.left_running(), sp.left_running()


def test_the_check_on_a_running_local_ray(serve_app):
    from kvserve.deploy.placement import PlacementError, can_add_nodes, check_placement

    # a local Ray's monitor is read-only (it reports within seconds of the start)
    assert _until("the autoscaler's report", lambda: can_add_nodes() is not None, 60) is True
    assert can_add_nodes() is False
    with pytest.raises(PlacementError, match=r"cannot add nodes: 5 workers need \{CPU: 1\} each, "
                       r"and the nodes hold 4 at once; .* Ways out: --workers 4; "
                       r"--cpus-per-worker 0\.8; "):
        check_placement(ServeConfig(num_workers=5))
    # totals that hold them pass, even with the app's workers holding some of them now
    check_placement(ServeConfig(num_workers=4))
    with pytest.raises(PlacementError, match=r"no node can hold one worker, which needs "
                       r"\{CPU: 1, GPU: 1\}.*--gpus-per-worker 0 \(CPU workers"):
        check_placement(ServeConfig(num_workers=1, num_gpus_per_worker=1))


@pytest.fixture
def ballast(serve_app) -> Iterator[Callable[[float], Any]]:
    """Takes CPUs of the session's Ray, until the test kills it or ends."""
    import ray

    @ray.remote
    class Ballast:
        def ping(self) -> bool:
            return True

    made = []

    def take(cpus: float) -> Any:
        b = Ballast.options(num_cpus=cpus).remote()
        ray.get(b.ping.remote(), timeout=WAIT_S)
        made.append(b)
        return b

    yield take
    for b in made:
        ray.kill(b)


def _free_cpus(serve_app) -> float:
    """The session Ray's free CPUs: all but its app's workers', once the CPUs of what
    earlier tests started are released (Ray's view of them lags their end)."""
    import ray
    from ray.util import placement_group_table

    cfg = serve_app.config
    free = ray.cluster_resources()["CPU"] - cfg.num_workers * cfg.num_cpus_per_worker
    try:
        _until(f"{free:g} CPUs free", lambda: ray.available_resources().get("CPU", 0.0) == free)
    except AssertionError as e:  # say what holds them: an earlier test's leak
        groups = [(g["name"], g["bundles"]) for g in placement_group_table().values()
                  if g["state"] != "REMOVED"]
        raise AssertionError(f"{e}; {ray.available_resources().get('CPU', 0.0):g} free; "
                             f"placement groups left: {groups}") from None
    return free


# joining takes a second model load: the heavy tier (the autoscaling test joins in it too)
@pytest.mark.parametrize("join", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_worker_without_room_waits_while_the_other_serves(serve_app, ballast, join):
    import ray

    free = _free_cpus(serve_app)
    assert free >= 2, f"the session's Ray has {free} CPUs beside its app's workers"
    held = ballast(free - 1)  # one CPU left: worker-0's, not worker-1's
    cfg = ServeConfig(num_workers=2, num_cpus_per_worker=1, engine=ENGINE,
                      router_name=WAITING_ROUTER, load_poll_interval_s=0.5)
    router = get_or_create_router(cfg.router_config(), WAITING_ROUTER)
    try:
        svc = Service(cfg, router=router)
        asyncio.run(svc.start())  # returns with worker-0 ready, worker-1 still waiting
        info = ray.get(router.server_info.remote())["workers"]
        assert (info[0]["state"], info[0]["alive"]) == ("ready", True), info
        assert (info[1]["state"], info[1]["alive"]) == (
            "waiting for resources: {CPU: 1}", False), info
        # the service serves meanwhile, through the ingress's own path
        got = asyncio.run(svc.complete(svc.build(svc.tokenize(prompt="Hello"), {
            "temperature": 0, "max_tokens": 4, "ignore_eos": True})))
        assert got.worker_id == "worker-0" and len(got.token_ids) == 4
        # waiting for every worker (--wait-for-all-workers) does not return while one waits
        all_ready = router.ready.remote(True)
        assert ray.wait([all_ready], timeout=3)[0] == []
        if not join:
            return
        ray.kill(held)  # room for worker-1: Ray places it, it loads and joins
        ray.get(all_ready, timeout=WAIT_S)
        info = ray.get(router.server_info.remote())["workers"]
        assert (info[1]["state"], info[1]["alive"]) == ("ready", True), info
        pick = ray.get(router.pick.remote([], None, [0], "to-worker-1"))
        assert pick["idx"] == 1, pick
        ray.get(router.release.remote(1, pick["slot_id"]))
    finally:
        kill_router(WAITING_ROUTER)


def test_a_worker_unplaced_past_the_timeout_is_stopped_and_reported(serve_app):
    import ray

    # 4 CPUs: what the session's Ray has, never free while the app's workers hold 2
    cfg = ServeConfig(num_workers=1, num_cpus_per_worker=4, engine=ENGINE,
                      router_name=UNPLACED_ROUTER, placement_timeout_s=3)
    router = get_or_create_router(cfg.router_config(), UNPLACED_ROUTER)
    reason = ("failed: not placed within 3 s (placement_timeout_s): waiting for resources: "
              "{CPU: 4}; no node had them free and none was added")
    try:
        with pytest.raises(StartupError) as e:
            ray.get(router.ready.remote(), timeout=WAIT_S)
        assert f"no worker started: worker-0: {reason}" in str(e.value)
        w = ray.get(router.server_info.remote())["workers"][0]
        assert (w["state"], w["alive"]) == (reason, False)

        def gone() -> bool:  # stopped: it takes no node later
            try:
                ray.get_actor("kvserve-unplaced-worker-0", namespace="kvserve")
                return False
            except ValueError:
                return True

        _until("the unplaced worker stopped", gone)
    finally:
        kill_router(UNPLACED_ROUTER)
