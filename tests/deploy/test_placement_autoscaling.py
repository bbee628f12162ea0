"""Workers that wait for a node an autoscaler adds: a Ray cluster on this machine with Ray's
fake autoscaler (a head of 2 CPUs; a node type of 1 CPU the autoscaler may launch), three
one-CPU workers, driven through the ingress's `Service` (the placement check, the router made
by the ingress's own path, GetServerInfo's data):

- the check lets the deployment through (the autoscaler may add nodes); two workers load on
  the head and serve, the third is shown as "waiting for resources: {CPU: 1}" meanwhile;
- once the autoscaler may launch a node (its configuration allows one), it adds it, Ray
  places the third worker there, and it serves;
- with every CPU taken and the autoscaler at its maximum, a worker is stopped after its
  placement timeout and reported failed with what it waited for: the router's `ready`
  (the ingress's start) fails with it, GetServerInfo's state and the router's log say it;
- an autoscaled pool whose load wants a second worker where no node has room: that worker
  waits for resources, the autoscaler adds a node for it, and it serves there.

`ray.cluster_utils.AutoscalingCluster` cannot be used here: its start and shutdown run `ray
stop --force`, which ends every Ray on the machine, and its configuration template
(fake_multi_node/example.yaml) is not in Ray's wheel. The fixture makes the same cluster with
`ray.cluster_utils.Cluster`: a head whose monitor runs Ray's FakeMultiNodeProvider (nodes
started as processes on this machine), which reloads its configuration file at each update.
Its nodes are this process's descendants and keep their files in a temporary RAY_TMPDIR;
the fixture ends exactly those. Marked `own_ray_cluster` (one Ray per process, see
tests/conftest.py) and `slow`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster
from serve_fixtures import ENGINE, free_port

from kvserve.deploy.config import ServeConfig
from kvserve.deploy.placement import can_add_nodes, check_placement
from kvserve.deploy.service import Service
from kvserve.errors import StartupError
from kvserve.router.lifecycle import get_or_create_router, kill_router

pytestmark = [pytest.mark.own_ray_cluster, pytest.mark.slow]

WAIT_S = 300.0  # bound on every wait for an observed event (a loaded machine is slow)
ROUTER = "kvserve-router-autoscaled"
LATE_ROUTER = "kvserve-router-late"
FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"
NODE_TYPE = "cpu.1"
ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}


def _config(gcs_address: str, max_nodes: int) -> dict[str, Any]:
    """The autoscaler's configuration: the head, and up to `max_nodes` nodes of 1 CPU."""
    return {
        "cluster_name": "kvserve-placement", "max_workers": max_nodes, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 60,
        "provider": {
            "type": "external", "gcs_address": gcs_address, "use_node_id_as_ip": True,
            "module": "ray.autoscaler._private.fake_multi_node.node_provider."
                      "FakeMultiNodeProvider",
            "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
            NODE_TYPE: {"resources": {"CPU": 1, "object_store_memory": 150 * 1024 * 1024},
                        "node_config": {}, "min_workers": 0, "max_workers": max_nodes}},
        "head_node_type": "ray.head.default", "auth": {}, "docker": {}, "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


class Autoscaled:
    def __init__(self, cluster: Cluster, config_path: Path, gcs_address: str, tmp: str) -> None:
        self.cluster, self.config_path, self.gcs_address, self.tmp = (
            cluster, config_path, gcs_address, tmp)

    def allow_nodes(self, n: int) -> None:
        """The autoscaler may launch up to `n` nodes (read at its next update)."""
        self.config_path.write_text(json.dumps(_config(self.gcs_address, n)))

    def log_text(self) -> str:
        """Every Ray log of the cluster's session, concatenated."""
        logs = Path(self.tmp) / "ray" / "session_latest" / "logs"
        return "\n".join(p.read_text(errors="replace") for p in logs.glob("*")
                         if p.is_file() and p.suffix in (".err", ".out", ".log"))


def _ours(tmp: str) -> list[psutil.Process]:
    """This process's descendants, and any process whose command line names our temporary
    folder (a node the autoscaler started, should it have outlived its parent)."""
    me = psutil.Process()
    procs = {p.pid: p for p in me.children(recursive=True)}
    for p in psutil.process_iter(["cmdline", "uids"]):
        with contextlib.suppress(psutil.Error):
            if p.info["uids"] and p.info["uids"].real == os.getuid() and any(
                    tmp in a for a in p.info["cmdline"] or ()):
                procs.setdefault(p.pid, p)
    procs.pop(me.pid, None)
    return list(procs.values())


@pytest.fixture(scope="module")
def autoscaled() -> Iterator[Autoscaled]:
    assert not ray.is_initialized(), (
        "a Ray is already up in this process; this module needs a cluster of its own "
        "(tests/conftest.py runs tests marked own_ray_cluster before the others)")
    tmp = tempfile.mkdtemp(prefix="kvas", dir="/tmp")  # short: Ray's socket paths are bounded
    saved = {k: os.environ.get(k) for k in [*ENV, "RAY_TMPDIR"]}
    os.environ.update({**ENV, "RAY_TMPDIR": tmp})  # (the monitor and its nodes inherit them)
    port = free_port()
    gcs = f"127.0.0.1:{port}"
    config_path = Path(tmp) / "autoscaling.json"
    a = Autoscaled(Cluster(), config_path, gcs, tmp)
    a.allow_nodes(0)  # none yet: the test decides when the node may come
    try:
        a.cluster.add_node(num_cpus=2, gcs_server_port=port, include_dashboard=False,
                           autoscaling_config=str(config_path),
                           env_vars={"RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID})
        ray.init(address=a.cluster.address, log_to_driver=False)
        yield a
    finally:
        ray.shutdown()
        left = _ours(tmp)
        a.cluster.shutdown()
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)


def _until(what: str, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S:.0f} s"
        time.sleep(0.25)
    return got


def _alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n["Alive"]]


def _complete(svc: Service, exclude: list[int]) -> Any:
    """A request on the worker a pick excluding `exclude` chooses (through its session)."""
    async def run() -> Any:
        pick = await svc.router.pick.remote([], "s", exclude)
        await svc.router.release.remote(pick["idx"], pick["slot_id"])
        req = svc.build(svc.tokenize(prompt="The capital of France is"),
                        {"temperature": 0, "max_tokens": 6, "ignore_eos": True}, "s")
        return await svc.complete(req)

    return asyncio.run(run())


def test_a_worker_waits_for_the_node_the_autoscaler_adds_and_the_service_serves(autoscaled):
    assert _until("the autoscaler's report", lambda: can_add_nodes() is not None) is True
    cfg = ServeConfig(num_workers=3, num_cpus_per_worker=1, engine=ENGINE, router_name=ROUTER,
                      load_poll_interval_s=0.5)
    check_placement(cfg)  # 3 CPUs asked, 2 there: the autoscaler may add a node
    svc = Service(cfg)  # the ingress's path: the check, then its router
    try:
        asyncio.run(svc.start())  # with two workers ready; the third waits
        info = asyncio.run(svc.server_info())["workers"]
        assert [(w["worker_id"], w["alive"], w["state"]) for w in info] == [
            ("worker-0", True, "ready"), ("worker-1", True, "ready"),
            ("worker-2", False, "waiting for resources: {CPU: 1}")], info
        assert len(_alive_nodes()) == 1  # no node yet: the autoscaler may launch none
        served = _complete(svc, [2])
        assert served.worker_id in ("worker-0", "worker-1") and len(served.token_ids) == 6

        autoscaled.allow_nodes(1)  # the autoscaler launches a node of 1 CPU for the demand
        node = _until("the added node", lambda: next(
            (n for n in _alive_nodes() if n["NodeID"] != FAKE_HEAD_NODE_ID), None))

        def joined() -> dict[str, Any] | None:
            w = asyncio.run(svc.server_info())["workers"][2]
            return w if w["alive"] and w["state"] == "ready" else None

        w = _until("worker-2 placed on the added node and ready", joined)
        assert w["node_id"] == node["NodeID"]
        on_new = _complete(svc, [0, 1])
        assert on_new.worker_id == "worker-2" and on_new.token_ids == served.token_ids
    finally:
        kill_router(ROUTER)


@ray.remote(num_cpus=1)
class Ballast:
    def ping(self) -> bool:
        return True


def test_a_worker_unplaced_past_the_timeout_is_reported_failed(autoscaled):
    # the first test's node is still there (its router is gone): every CPU of the cluster
    # taken, and the autoscaler at its maximum of one node, a worker has nowhere to go
    assert len(_alive_nodes()) == 2
    ballast = [Ballast.remote() for _ in range(int(ray.cluster_resources()["CPU"]))]
    ray.get([b.ping.remote() for b in ballast], timeout=WAIT_S)
    cfg = ServeConfig(num_workers=1, num_cpus_per_worker=1, engine=ENGINE,
                      router_name=LATE_ROUTER, placement_timeout_s=4)
    check_placement(cfg)  # it fits the nodes' totals
    router = get_or_create_router(cfg.router_config(), LATE_ROUTER)
    reason = ("failed: not placed within 4 s (placement_timeout_s): waiting for resources: "
              "{CPU: 1}; no node had them free and none was added")
    try:
        with pytest.raises(StartupError, match=re.escape(f"no worker started: worker-0: {reason}")):
            ray.get(router.ready.remote(), timeout=WAIT_S)
        w = ray.get(router.server_info.remote())["workers"][0]
        assert (w["state"], w["alive"]) == (reason, False)
        assert len(_alive_nodes()) == 2  # the autoscaler added none beyond its maximum
        _until("the router's log line",
               lambda: f"worker-0 {reason}; stopped it" in autoscaled.log_text())
    finally:
        kill_router(LATE_ROUTER)
        for b in ballast:
            ray.kill(b)


POOL_ROUTER = "kvserve-router-pool"


def test_a_worker_the_load_wants_gets_the_node_the_autoscaler_adds(autoscaled):
    """Autoscaling on a cluster without room: the load (requests waiting on the one worker,
    whose engine is held) wants a second worker; it waits for resources, shown as such, and
    its pending actor is the demand for which Ray's autoscaler adds a node; it is placed
    there, loads and serves."""
    # the earlier tests' node is there (3 CPUs in all, their routers gone): all but one CPU
    # taken, the one worker fits and a second does not
    assert len(_alive_nodes()) == 2
    _until("the earlier tests' CPUs free", lambda: ray.available_resources().get("CPU") == 3.0)
    ballast = Ballast.options(num_cpus=2).remote()
    ray.get(ballast.ping.remote(), timeout=WAIT_S)
    cfg = ServeConfig(num_cpus_per_worker=1, engine=ENGINE, router_name=POOL_ROUTER,
                      load_poll_interval_s=0.5,
                      autoscaling={"min_workers": 1, "max_workers": 2, "upscale_delay_s": 1,
                                   "downscale_delay_s": 600, "upscale_waiting": 3})
    check_placement(cfg)  # 2 workers of 1 CPU: the nodes' totals hold them
    svc = Service(cfg)
    try:
        asyncio.run(svc.start())
        w0 = ray.get(svc.router.workers.remote())[0]
        ray.get(w0.pause_engine.remote())

        async def three() -> list[Any]:
            reqs = [svc.build(svc.tokenize(prompt=f"Tale {i}: once upon a time"),
                              {"temperature": 0, "max_tokens": 4, "ignore_eos": True})
                    for i in range(3)]
            return await asyncio.gather(*(svc.complete(r) for r in reqs))

        # Not `with`: should a check fail while the engine is held, the executor's exit
        # would wait on the three requests forever and hide the failure.
        ex = ThreadPoolExecutor(1)
        try:
            waiting = ex.submit(asyncio.run, three())
            want = "waiting for resources: {CPU: 1}"

            def worker1() -> dict[str, Any] | None:
                ws = ray.get(svc.router.server_info.remote())["workers"]
                return ws[1] if len(ws) > 1 and ws[1]["state"] == want else None

            w = _until("worker-1 waiting for resources", worker1)
            assert not w["alive"]
            a = asyncio.run(svc.server_info())["autoscaling"]
            assert a["decisions"] == {"up:queue": 1} and a["starting_workers"] == 1, a
            assert len(_alive_nodes()) == 2  # the autoscaler may add none yet

            before = {n["NodeID"] for n in _alive_nodes()}
            autoscaled.allow_nodes(2)  # now it may: it adds one for the pending worker
            node = _until("the added node", lambda: next(
                (n for n in _alive_nodes() if n["NodeID"] not in before), None))

            def serving() -> dict[str, Any] | None:
                w = ray.get(svc.router.server_info.remote())["workers"][1]
                return w if w["alive"] and w["state"] == "ready" else None

            assert _until("worker-1 placed and ready", serving)["node_id"] == node["NodeID"]
            ray.get(w0.resume_engine.remote())
            done = waiting.result(timeout=WAIT_S)
        finally:
            with contextlib.suppress(Exception):  # a failed check: let the requests end
                ray.get(w0.resume_engine.remote(), timeout=WAIT_S)
            ex.shutdown(wait=False)  # the router's kill below ends any still waiting
        assert all(len(r.token_ids) == 4 for r in done)
        on_new = _complete(svc, [0])
        assert on_new.worker_id == "worker-1" and len(on_new.token_ids) == 6
        a = asyncio.run(svc.server_info())["autoscaling"]
        (cold,) = a["cold_starts"]
        assert cold["worker_id"] == "worker-1" and cold["cold_start_s"] >= cold["load_s"] > 0
    finally:
        kill_router(POOL_ROUTER)
        ray.kill(ballast)
