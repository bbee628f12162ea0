"""Several nodes: a three-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a
head without CPUs, where the router and this driver run, and two worker nodes, each with a
custom resource to place things on it), served through the ingress's Service in this
process, on a router made by the ingress's own path (`get_or_create_router`):

- the router runs on the head and the two workers on the two worker nodes (Ray's SPREAD:
  its default would pack both onto the first node, which has room for both); each node
  serves, and a follow-up sharing a prompt prefix goes back to the node that holds it
  (a prefix hit there) although the other one is less loaded;
- a stream moved mid-generation from a worker on one node to the other: its snapshot goes
  from object store to object store; the output is that of an unmoved run;
- a worker node killed (its processes SIGKILLed) while a stream on it produces tokens and
  a second request waits there for its first token: the first ends with UNAVAILABLE after
  its tokens, the second is retried on the other node with the unmoved output; the router
  marks the lost worker restarting, the other keeps serving (an ingress replica starting
  meanwhile included), no KV or router slot is left;
- the lost worker finds no node with room (a ballast actor fills the survivor) until a
  third node joins: Ray restarts it there (same worker id), and the router serves with it;
- draining the worker on the joined node hands its streams to the other node.

The tests run in order, each on the cluster the previous one left.

One Ray per process: a Cluster cannot share this process with the session's Ray
(tests/serve_fixtures.py). The module is marked `own_ray_cluster`, and tests/conftest.py
runs such tests before all others, so the session's Ray starts after this cluster has been
shut down; run alone, the module needs nothing else. The cluster keeps its files under a
temporary RAY_TMPDIR: a Cluster writes its address to <temp dir>/ray/ray_current_cluster,
where any `ray.init()` without an address on this machine would otherwise join it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from kvserve.deploy import admin
from kvserve.deploy.config import ServeConfig
from kvserve.deploy.errors import ServiceError
from kvserve.deploy.service import Result, Service
from kvserve.router.lifecycle import get_or_create_router, kill_router

pytestmark = [pytest.mark.own_ray_cluster, pytest.mark.slow]

NODE_CPUS = 4  # room for every worker on one node: only spreading puts them on two
ENGINE = {"num_threads": 1, "kv_cache_tokens": 2048, "max_model_len": 512, "max_num_seqs": 8,
          "host_cache_gib": 0.05}
# worker 1 runs one request at a time: a second one waits there without a token
ONE_AT_A_TIME = {1: {"max_num_seqs": 1}}
# a lost node is declared dead after about 3 s (Ray's default: 15 s); a live one under load
# would have to miss 3 checks of 10 s each
HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
ROUTER = "kvserve-router-multinode"
SHORT = 16
MOVED = 64
DOOMED = 400  # cannot finish before its node is killed, however fast the machine
WAIT_S = 180.0  # bound on every wait for an observed event (a loaded machine is slow)
NODE_START_TRIES = 3


@dataclass
class Nodes:
    cluster: Cluster
    by_name: dict[str, Any] = field(default_factory=dict)  # "a", "b", "c" -> Ray's Node
    ballast: Any = None  # an actor filling a node's spare CPUs

    def add(self, name: str) -> Any:
        node = _add_node(self.cluster, num_cpus=NODE_CPUS, resources={f"node_{name}": 1})
        self.by_name[name] = node
        return node

    def name_of(self, node_id: str) -> str:
        return next(k for k, n in self.by_name.items() if n.node_id == node_id)


def _add_node(cluster: Cluster, **args: Any) -> Any:
    """`cluster.add_node`, tried again when Ray's fixed 30 s for a node to register with the
    GCS run out (a loaded host); the processes of the failed try are stopped first, so
    that no node registers late behind the test's back."""
    me = psutil.Process()
    for attempt in range(NODE_START_TRIES):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            return cluster.add_node(**args)
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == NODE_START_TRIES - 1:
                raise
            started = [p for p in me.children(recursive=True) if p.pid not in before]
            for p in started:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(started, timeout=30)


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    assert not ray.is_initialized(), (
        "a Ray is already up in this process; this module needs a cluster of its own "
        "(tests/conftest.py runs tests marked own_ray_cluster before the others)")
    tmp = tempfile.mkdtemp(prefix="kvmn", dir="/tmp")  # short: Ray's socket paths are bounded
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = Cluster()
    try:
        # the head, without the processes the tests do not use (the autoscaler's monitor,
        # the log monitor): each one slows the start of the others on a small host, and Ray
        # gives a node 30 s to register
        _add_node(cluster, num_cpus=0, include_dashboard=False, no_monitor=True,
                  include_log_monitor=False, _system_config=HEALTH)
        n = Nodes(cluster)
        n.add("a")
        n.add("b")
        ray.init(address=cluster.address, log_to_driver=False)
        yield n
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def svc(nodes: Nodes) -> Iterator[Service]:
    cfg = ServeConfig(num_workers=2, num_cpus_per_worker=1, engine=ENGINE,
                      load_poll_interval_s=0.5, router_name=ROUTER)
    rc = cfg.router_config()
    rc.engine_overrides = ONE_AT_A_TIME
    s = Service(cfg, router=get_or_create_router(rc, ROUTER))
    try:
        asyncio.run(s.start())
        yield s
    finally:
        kill_router(ROUTER)


@ray.remote
class Ballast:
    """Takes a node's spare CPUs, so that a worker cannot be restarted there."""

    def ping(self) -> bool:
        return True


def _greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_tokens": n, "ignore_eos": True}


def _info(svc: Service) -> dict[str, Any]:
    return ray.get(svc.router.server_info.remote())


async def _bind(svc: Service, session: str, idx: int) -> str:
    """Pin `session` to worker `idx` (a pick that excludes every other worker)."""
    others = [i for i in range(len(svc.workers)) if i != idx]
    pick = await svc.router.pick.remote([], session, others)
    assert pick["idx"] == idx, pick
    await svc.router.release.remote(idx, pick["slot_id"])
    return session


async def _run(svc: Service, ids: list[int], n: int, session: str | None = None,
               rid: str | None = None) -> Result:
    return await svc.complete(svc.build(list(ids), _greedy(n), session, rid))


async def _until(what: str, check: Callable[[], Any]) -> None:
    """Wait for an observed event: `check()` (which may be a coroutine) turning true."""
    deadline = time.monotonic() + WAIT_S
    while True:
        ok = check()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S:.0f} s"
        await asyncio.sleep(0.05)


def _wait(what: str, check: Callable[[], Any]) -> None:
    asyncio.run(_until(what, check))


def _wait_clean(svc: Service, workers: list[int]) -> None:
    """No stream, KV block or host block left on these workers, no router slot anywhere."""
    handles = ray.get(svc.router.workers.remote())

    def clean() -> bool:
        loads = [ray.get(handles[i].load.remote()) for i in workers]
        return all(ld["stats"]["kv_blocks_used"] == 0 and ld["stats"]["host_blocks_used"] == 0
                   and ld["parked"] == ld["running"] == ld["waiting"] == ld["streams"] == 0
                   for ld in loads)

    _wait("KV left behind", clean)
    _wait("router slots left", lambda: not any(w["inflight"] for w in _info(svc)["workers"]))


def test_router_on_the_head_workers_spread_over_the_worker_nodes(nodes, svc):
    info = _info(svc)
    assert info["node_id"] == nodes.cluster.head_node.node_id
    on = [w["node_id"] for w in info["workers"]]
    assert sorted(nodes.name_of(n) for n in on) == ["a", "b"], on
    assert all(w["alive"] and w["state"] == "ready" for w in info["workers"])


def test_each_node_serves_and_a_shared_prefix_goes_back_to_its_node(nodes, svc):
    prompts = [svc.tokenize(prompt=f"Log {k}: " + " ".join(
        f"the tide at station {k}.{j} rose by {j} metres." for j in range(8))) for k in range(2)]
    more = svc.tokenize(prompt=" What comes next?")

    async def run(idx: int) -> tuple[Result, Result]:
        first = await _run(svc, prompts[idx], SHORT, await _bind(svc, f"own-{idx}", idx))
        # one request held on worker idx: least-loaded routing alone would pick the other
        other = 1 - idx
        held = await svc.router.pick.remote([], None, [other])
        try:
            follow = await _run(svc, prompts[idx] + more, SHORT)  # no session: the prefix only
        finally:
            await svc.router.release.remote(idx, held["slot_id"])
        return first, follow

    for idx in (0, 1):
        first, follow = asyncio.run(run(idx))
        assert first.worker_id == follow.worker_id == f"worker-{idx}"
        assert follow.usage[1] >= len(prompts[idx]) // 16 * 16  # the prompt's full blocks hit
        assert first.finish_reason == follow.finish_reason == "length"
    _wait_clean(svc, [0, 1])


def test_a_stream_moves_to_the_other_node_through_the_object_store(nodes, svc):
    prompt = svc.tokenize(prompt="Write a long story about a lighthouse keeper and the sea.")
    before = [w["stats"] for w in _info(svc)["workers"]]

    async def run() -> tuple[Result, list[dict[str, Any]], dict[str, Any]]:
        ref = await _run(svc, prompt, MOVED, await _bind(svc, "unmoved", 1))
        req = svc.build(list(prompt), _greedy(MOVED), await _bind(svc, "moved", 0), "moved")
        chunks: list[dict[str, Any]] = []
        moved: dict[str, Any] = {}
        async for chunk in svc.stream(req):
            chunks.append(chunk)
            if not moved:  # after its first chunk: the stream is under way on worker 0
                assert chunk["finish_reason"] is None and chunk["worker_id"] == "worker-0"
                moved = await svc.router.move_stream.remote("moved", 0, 1)
        return ref, chunks, moved

    ref, chunks, moved = asyncio.run(run())
    assert "error" not in moved, moved
    # far over Ray's 100 KiB limit for objects passed inline: the KV went through the
    # source node's object store to the target's
    assert moved["bytes"] > 100 * 1024, moved
    info = _info(svc)["workers"]
    assert info[0]["node_id"] != info[1]["node_id"]
    assert [t for c in chunks for t in c["token_ids"]] == ref.token_ids
    assert "".join(c["text"] for c in chunks) == ref.text
    assert chunks[-1]["worker_id"] == "worker-1" and chunks[-1]["finish_reason"] == "length"
    assert info[1]["stats"]["migration_streams_in"] == before[1]["migration_streams_in"] + 1
    assert info[0]["stats"]["migration_streams_out"] == before[0]["migration_streams_out"] + 1
    _wait_clean(svc, [0, 1])


def test_a_worker_node_lost_mid_stream(nodes, svc):
    info = _info(svc)["workers"]
    lost, kept = nodes.name_of(info[1]["node_id"]), nodes.name_of(info[0]["node_id"])
    # the survivor's spare CPUs taken: the lost worker cannot be restarted there
    ballast = Ballast.options(num_cpus=NODE_CPUS - 1, resources={f"node_{kept}": 0.01}).remote()
    ray.get(ballast.ping.remote())
    nodes.ballast = ballast  # released by the next test, once a node has joined
    long_prompt = svc.tokenize(prompt="Tell the whole history of the lighthouse, year by year.")
    waiting = svc.tokenize(prompt="A short note on the harbour master's boat:")
    handles = ray.get(svc.router.workers.remote())
    retries = svc.retries

    async def run() -> tuple[BaseException | None, int, Result, Result]:
        ref = await _run(svc, waiting, SHORT, await _bind(svc, "unharmed", 0))
        session = await _bind(svc, "doomed", 1)
        got: list[int] = []
        first = asyncio.Event()

        async def doomed() -> None:
            async for c in svc.stream(svc.build(list(long_prompt), _greedy(DOOMED), session)):
                got.extend(c["token_ids"])
                first.set()

        stream = asyncio.create_task(doomed())
        await _until("the doomed stream's first tokens", first.is_set)
        behind = asyncio.create_task(_run(svc, waiting, SHORT, session, "behind"))

        async def queued() -> bool:  # waiting in worker 1's engine, no token yet
            return (await handles[1].load.remote())["waiting"] == 1

        await _until("the second request queued behind the first", queued)
        await asyncio.to_thread(nodes.cluster.remove_node, nodes.by_name[lost], False)
        err = None
        try:
            await stream
        except ServiceError as e:
            err = e
        return err, len(got), await behind, ref

    err, sent, behind, ref = asyncio.run(run())
    assert isinstance(err, ServiceError) and err.kind == "unavailable", err
    assert err.grpc_code.name == "UNAVAILABLE"
    assert f"after {sent} tokens" in err.message and 0 < sent < DOOMED
    # the request that had no token yet was retried on the other node, unharmed
    assert behind.worker_id == "worker-0" and behind.token_ids == ref.token_ids
    assert svc.retries == retries + 1

    def marked() -> bool:
        w = _info(svc)["workers"][1]
        return not w["alive"] and w["state"] == "restarting"

    _wait("the router marks the lost worker", marked)
    # the other node keeps serving, also through an ingress replica that starts now (Serve
    # replacing one): the worker waiting for a node does not hold its start-up
    fresh = Service(svc.cfg, router=svc.router)
    asyncio.run(fresh.start())
    again = asyncio.run(_run(fresh, waiting, SHORT))
    assert again.worker_id == "worker-0" and again.token_ids == ref.token_ids
    _wait_clean(svc, [0])


def test_a_node_that_joins_takes_the_lost_worker(nodes, svc):
    assert not _info(svc)["workers"][1]["alive"]
    joined = nodes.add("c")

    def back() -> bool:
        w = _info(svc)["workers"][1]
        return w["alive"] and w["state"] == "ready" and w["node_id"] == joined.node_id

    _wait("worker 1 restarted on the joined node", back)
    w = _info(svc)["workers"][1]
    assert w["worker_id"] == "worker-1" and w["restarts"] == 1
    prompt = svc.tokenize(prompt="A short note on the harbour master's boat:")

    async def run() -> tuple[Result, Result]:
        return (await _run(svc, prompt, SHORT, await _bind(svc, "on-c", 1)),
                await _run(svc, prompt, SHORT, await _bind(svc, "on-kept", 0)))

    on_c, on_kept = asyncio.run(run())
    assert on_c.worker_id == "worker-1" and on_c.token_ids == on_kept.token_ids
    ray.kill(nodes.ballast)
    _wait_clean(svc, [0, 1])


def test_draining_the_worker_on_the_joined_node(nodes, svc):
    prompts = [svc.tokenize(prompt=f"Chapter {k}: the storm reached the island at") for k in range(2)]
    handles = ray.get(svc.router.workers.remote())
    assert _info(svc)["workers"][1]["node_id"] == nodes.by_name["c"].node_id

    async def run() -> tuple[list[Result], list[Result], dict[str, Any]]:
        s0 = await _bind(svc, "refs", 0)
        refs = [await _run(svc, p, MOVED, s0) for p in prompts]
        s1 = await _bind(svc, "drained", 1)
        tasks = [asyncio.create_task(_run(svc, p, MOVED, s1)) for p in prompts]

        async def all_there() -> bool:  # one running, one queued (one at a time there)
            return len(await handles[1].unfinished_ids.remote()) == len(prompts)

        await _until("the streams on worker 1", all_there)
        drained = await admin.drain(svc, "worker-1", 300.0)  # what DrainWorker runs
        return refs, await asyncio.gather(*tasks), drained

    refs, got, drained = asyncio.run(run())
    assert drained["drained"] and drained["worker_id"] == "worker-1", drained
    assert drained["streams_moved"] == len(prompts), drained
    assert [r.token_ids for r in got] == [r.token_ids for r in refs]
    assert all(r.worker_id == "worker-0" for r in got)
    info = _info(svc)["workers"]
    assert info[1]["stats"]["drained"] == 1 and not info[1]["alive"]
    with pytest.raises(ray.exceptions.RayActorError):  # stopped for good, no restart
        ray.get(handles[1].ping.remote(), timeout=60)
    _wait_clean(svc, [0])
