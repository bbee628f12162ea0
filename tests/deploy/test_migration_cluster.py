"""Migration and drain on a cluster of its own (real Ray, three workers on the default
model, worker 0 with a tiny device KV pool), driven through the ingress's Service: parked
streams move to a worker with room; a target killed mid-import, or already dead, leaves the
stream at its source; a session whose worker is full takes its host-cached prefix to its
new worker; a drained worker hands its streams over, its sessions' cached
prefixes with them. Every output is identical to an unmoved run, no request fails, no KV is
left behind. The tests run in order (the last three kill or stop workers).

No test relies on timing for the state it checks: worker 0's engine is held (paused and
stepped by hand) while streams must stay parked or unfinished, and planned migrations are
off except where the planner is what is tested, so it cannot move streams meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from serve_fixtures import ray_started

from kvserve.deploy import admin
from kvserve.deploy.config import ServeConfig
from kvserve.deploy.service import Result, Service
from kvserve.kvcache.hashing import hash_full_blocks
from kvserve.router.config import RouterConfig
from kvserve.router.router import RouterActor
from kvserve.sampling import SamplingParams

# a Ray cluster of its own (~90 s on the 2-core host); the default tier moves streams on the
# shared service (test_serve_migration.py)
pytestmark = pytest.mark.slow

ENGINE = {"num_threads": 1, "kv_cache_tokens": 4096, "max_model_len": 512, "max_num_seqs": 16,
          "host_cache_gib": 0.2, "host_restore_policy": "copy"}
# 16 blocks, greedy admission; a context that pool can hold
TINY = {"kv_cache_tokens": 256, "max_model_len": 256, "admission_lookahead_tokens": 0}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    own = not ray.is_initialized()
    if own:
        ray_started(lambda: ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False))
    cfg = RouterConfig(num_workers=3, engine=ENGINE, num_cpus_per_worker=0.5,
                       max_imbalance=100, load_poll_interval_s=0.5, engine_overrides={0: TINY},
                       migration={"enabled": False, "park_threshold_s": 0.5,
                                  "min_interval_s": 2.0, "rebalance": False})
    router = ray.remote(RouterActor).options(num_cpus=0, max_concurrency=1000).remote(
        cfg.to_dict())
    ray.get(router.ready.remote())
    try:
        yield router
    finally:
        ray.kill(router)
        if own:
            ray.shutdown()


def _prompt(i: int) -> str:
    return f"Story {i}: once upon a time, in a village by the sea, a child named Ana{i} found"


def _reference(smol_llm, n: int) -> list[list[int]]:
    p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in smol_llm.generate([_prompt(i) for i in range(n)], p)]


@pytest.fixture(scope="module")
def svc(cluster) -> Service:
    """The ingress's request path, in this process, on the cluster's router."""
    s = Service(ServeConfig(num_workers=3, engine=ENGINE), router=cluster)
    asyncio.run(s.start())
    return s


async def _run(svc: Service, i: int, session: str, rid: str | None = None) -> Result:
    req = svc.build(svc.tokenize(prompt=_prompt(i)),
                    {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}, session, rid)
    return await svc.complete(req)


async def _session_on_worker0(router: Any, session: str) -> str:
    """Bind `session` to worker 0 (left alone, a new session goes to the emptier worker 1)."""
    pick = await router.pick.remote([], session, [1, 2])
    assert pick["idx"] == 0
    await router.release.remote(0, pick["slot_id"])
    return session


def _stats(router: Any) -> list[dict[str, float]]:
    return [w["stats"] for w in ray.get(router.server_info.remote())["workers"]]


def _engine_stats(router: Any, idx: int) -> dict[str, float]:
    """Worker `idx`'s engine counters as they are now: the router's copy (`_stats`) is that of
    its last poll of the worker, which may not have seen the last request yet."""
    return ray.get(ray.get(router.workers.remote())[idx].stats.remote())


def _wait_clean(router: Any, workers: list[int]) -> None:
    handles = ray.get(router.workers.remote())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        loads = [ray.get(handles[i].load.remote()) for i in workers]
        if all(ld["stats"]["kv_blocks_used"] == 0 and ld["stats"]["host_blocks_used"] == 0
               and ld["parked"] == ld["running"] == ld["waiting"] == 0 for ld in loads):
            return
        time.sleep(0.25)
    raise AssertionError(f"KV left behind: {[ld['stats'] for ld in loads]}")


def _wait_no_inflight(router: Any) -> None:
    """Every router slot given back (the ingress releases just after the last chunk)."""
    deadline = time.monotonic() + 10
    while True:
        inflight = [w["inflight"] for w in ray.get(router.server_info.remote())["workers"]]
        if not any(inflight) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert inflight == [0, 0, 0]


async def _until(what: str, probe: Any, done: Any, timeout: float = 120.0) -> Any:
    """Call `probe()` until `done(result)`; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = await probe()
        if done(got):
            return got
        assert time.monotonic() < deadline, f"{what}: {got}"
        await asyncio.sleep(0.05)


async def _burst_parked_on_worker0(cluster: Any, svc: Service, w0: Any, n: int,
                                    session: str) -> tuple[list[asyncio.Task], dict[str, Any]]:
    """`n` requests of one session, all on worker 0 with its engine held (the caller pauses
    it), stepped by hand until its tiny pool has parked some of them while others run:
    (the requests' tasks, worker 0's load then)."""
    await _session_on_worker0(cluster, session)
    tasks = [asyncio.create_task(_run(svc, i, session)) for i in range(n)]
    await _until("the streams never all reached worker 0", w0.load.remote,
                 lambda ld: ld["waiting"] == n)
    # admitted together, their KV outgrows the tiny pool: some are evicted (parked)
    load = await w0.step_engine.remote()
    for _ in range(200):
        if load["parked"]:
            break
        load = await w0.step_engine.remote()
    assert load["parked"] and load["running"], load
    return tasks, load


def test_parked_streams_move_to_the_worker_with_room(cluster, svc, smol_llm):
    """Worker 0's engine is held while the streams arrive, then stepped by hand until its
    pool has parked some of them; held, it cannot restore them, so only the planner (off
    while the state is built) can serve them: each moves to a worker with room and finishes
    there. No timing decides what is tested: the state is built and held, then observed."""
    n = 6
    want = _reference(smol_llm, n)
    w0 = ray.get(cluster.workers.remote())[0]

    async def moved_in() -> float:
        s = await cluster.server_info.remote()
        return sum(w["stats"]["migration_streams_in"] for w in s["workers"][1:])

    async def run() -> tuple[list[Result], set[str], dict[str, Any]]:
        await w0.pause_engine.remote()  # (planned migrations are off: nothing moves yet)
        tasks: list[asyncio.Task] = []
        try:
            tasks, load = await _burst_parked_on_worker0(cluster, svc, w0, n, "hot")
            parked = {p["request_id"] for p in load["parked_streams"]}
            start = await moved_in()
            await cluster.set_migration.remote(True)
            try:
                await _until("the planner never moved the parked streams", moved_in,
                             lambda m: m - start >= len(parked))
            finally:
                await cluster.set_migration.remote(False)  # worker 0 parks more once resumed
            held = await w0.load.remote()  # still held: the moved streams left, no others
            assert await moved_in() - start == len(parked)
        finally:
            await w0.resume_engine.remote()
        return await asyncio.gather(*tasks), parked, held

    before, evictions = _stats(cluster), _engine_stats(cluster, 0)["evictions"]
    got, parked, held = asyncio.run(run())
    after = _stats(cluster)  # the router's own migration counters are current
    assert held["parked"] == 0 and held["running"] + held["waiting"] == n - len(parked), held
    assert [r.token_ids for r in got] == want
    assert all(r.finish_reason == "length" and r.usage[2] == MAX_TOKENS for r in got)
    assert _engine_stats(cluster, 0)["evictions"] > evictions
    moved = sum(after[i]["migration_streams_in"] - before[i]["migration_streams_in"]
                for i in (1, 2))
    assert moved == len(parked)
    assert after[0]["migration_streams_out"] - before[0]["migration_streams_out"] == moved
    assert after[0]["migration_bytes_out"] > before[0]["migration_bytes_out"]
    assert sum(r.worker_id != "worker-0" for r in got) == moved  # finished where they moved
    _wait_clean(cluster, [0, 1, 2])
    _wait_no_inflight(cluster)


def test_a_session_leaving_its_full_worker_takes_its_cached_prefix(cluster, svc, smol_llm):
    handles = ray.get(cluster.workers.remote())
    conv = svc.tokenize(prompt=" ".join(f"Entry {k}: the ship left the harbour at noon."
                                        for k in range(8)))
    first = hash_full_blocks(conv, 16)
    short = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}

    async def on_host(worker: int) -> bool:
        return first[0] in (await handles[worker].load.remote())["held"]["host"]

    async def run() -> tuple[Result, Result, int]:
        turn1 = await svc.complete(svc.build(conv, short, await _session_on_worker0(cluster, "trip")))
        assert turn1.worker_id == "worker-0"
        filler = await _session_on_worker0(cluster, "filler")
        await asyncio.gather(*(_run(svc, i, filler) for i in range(4)))  # evicts it to host
        assert await on_host(0)
        # worker 0 is idle now: wait until a router poll has seen what its host tier holds
        host = len((await handles[0].load.remote())["held"]["host"])
        await _until("no router poll saw worker 0's host tier",
                     cluster.server_info.remote,
                     lambda i: i["workers"][0]["held_host_blocks"] == host)
        old = await cluster.set_max_inflight_per_worker.remote(1)
        held = await cluster.pick.remote([], None, [1, 2])  # worker 0 is full now
        try:
            conv.extend(turn1.token_ids)
            conv.extend(svc.tokenize(prompt=" And then?"))
            turn2 = await svc.complete(svc.build(list(conv), short, "trip"))
        finally:
            await cluster.release.remote(0, held["slot_id"])
            await cluster.set_max_inflight_per_worker.remote(old)
        return turn1, turn2, int(turn2.worker_id.rsplit("-", 1)[1])

    before = _stats(cluster)
    turn1, turn2, new = asyncio.run(run())
    assert new != 0
    deadline = time.monotonic() + 30
    while _stats(cluster)[new]["migration_sessions_in"] == before[new]["migration_sessions_in"]:
        assert time.monotonic() < deadline, "the session's prefix never reached its new worker"
        time.sleep(0.2)
    after = _stats(cluster)
    blocks = after[new]["migration_session_blocks_in"] - before[new]["migration_session_blocks_in"]
    assert blocks >= len(first)  # every full block of the first turn's prompt came over
    # the next turn stays with the session on its new worker and is a prefix hit there
    turn3 = conv + svc.tokenize(prompt=" Go on.")
    nxt = asyncio.run(svc.complete(svc.build(turn3, short, "trip")))
    assert nxt.worker_id == turn2.worker_id and nxt.usage[1] >= len(first) * 16
    assert nxt.token_ids == smol_llm.generate(
        [turn3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    _wait_clean(cluster, [0, 1, 2])
    _wait_no_inflight(cluster)


async def _mid_generation_on_worker0(w0: Any, svc: Service, session: str,
                                     rid: str) -> asyncio.Task:
    """Start request `rid` (prompt 0) on worker 0 and hold it there mid-generation: worker
    0's engine is paused before it arrives and stepped three times (prefill and two
    tokens). The caller resumes the engine."""
    await w0.pause_engine.remote()
    task = asyncio.create_task(_run(svc, 0, session, rid))
    await _until(f"{rid} never reached worker 0", w0.unfinished_ids.remote, lambda ids: rid in ids)
    for _ in range(3):
        await w0.step_engine.remote()
    return task


def test_target_killed_mid_import_returns_the_stream_to_its_source(cluster, svc, smol_llm):
    want = _reference(smol_llm, 1)
    handles = ray.get(cluster.workers.remote())
    ray.get(handles[2].set_import_delay.remote(30.0))  # the stream sits in worker 2's engine

    async def run() -> tuple[Result, dict[str, Any]]:
        session = await _session_on_worker0(cluster, "mid-import")
        task = await _mid_generation_on_worker0(handles[0], svc, session, "killed-mid-import")
        try:
            move = cluster.move_stream.remote("killed-mid-import", 0, 2, "snapshot")
            await _until("the import never reached worker 2's engine",
                         handles[2].unfinished_ids.remote, lambda ids: "killed-mid-import" in ids)
            ray.kill(handles[2], no_restart=False)  # Ray restarts it with an empty engine
            moved = await move
        finally:
            await handles[0].resume_engine.remote()
        return await task, moved

    before = _stats(cluster)
    got, moved = asyncio.run(run())
    assert "error" in moved and moved["returned"], moved
    assert got.token_ids == want[0] and got.worker_id == "worker-0"
    assert got.finish_reason == "length" and got.usage[2] == MAX_TOKENS
    after = _stats(cluster)
    assert after[2]["migration_failures"] == before[2]["migration_failures"] + 1
    assert after[0]["migration_streams_out"] == before[0]["migration_streams_out"]
    deadline = time.monotonic() + 120
    while True:  # Ray restarts worker 2 (its model loads again)
        try:
            ray.get(ray.get(cluster.workers.remote())[2].ping.remote(), timeout=30)
            break
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            assert time.monotonic() < deadline, "worker 2 never came back"
            time.sleep(0.5)
    _wait_clean(cluster, [0, 1, 2])  # the restarted worker 2 holds nothing of it
    _wait_no_inflight(cluster)


def test_move_to_a_dead_worker_leaves_the_stream_at_its_source(cluster, svc, smol_llm):
    want = _reference(smol_llm, 1)
    handles = ray.get(cluster.workers.remote())
    ray.kill(handles[2], no_restart=True)  # the target is gone when the import is sent

    async def run() -> tuple[Result, dict[str, Any]]:
        session = await _session_on_worker0(cluster, "fail")
        task = await _mid_generation_on_worker0(handles[0], svc, session, "to-the-dead")
        try:
            moved = await cluster.move_stream.remote("to-the-dead", 0, 2, "snapshot")
        finally:
            await handles[0].resume_engine.remote()
        return await task, moved

    before, returned = _stats(cluster), _engine_stats(cluster, 0)["migration_returned"]
    got, moved = asyncio.run(run())
    assert "error" in moved and moved["returned"], moved
    assert got.token_ids == want[0] and got.worker_id == "worker-0"
    after = _stats(cluster)  # the router's own counters are current
    assert after[2]["migration_failures"] == before[2]["migration_failures"] + 1
    assert _engine_stats(cluster, 0)["migration_returned"] == returned + 1
    _wait_clean(cluster, [0, 1])


def test_target_killed_mid_live_copy_leaves_the_stream_running_at_its_source(
        cluster, svc, smol_llm):
    """A live move whose target dies during the pre-copy rounds: the stream never stopped
    on its source, finishes there with the unmoved output, and nothing stays reserved or
    frozen on either side."""
    want = _reference(smol_llm, 1)
    handles = ray.get(cluster.workers.remote())
    ray.get(handles[1].set_import_delay.remote(30.0))  # each live write answers 30 s late

    async def run() -> tuple[Result, dict[str, Any]]:
        session = await _session_on_worker0(cluster, "mid-copy")
        task = await _mid_generation_on_worker0(handles[0], svc, session, "killed-mid-copy")
        try:
            move = cluster.move_stream.remote("killed-mid-copy", 0, 1, "live")
            await _until("the live move never reached worker 1", handles[1].live_moves.remote,
                         lambda m: "killed-mid-copy" in m["in"])
            ray.kill(handles[1], no_restart=False)  # Ray restarts it with an empty engine
            moved = await move
            out = await handles[0].live_moves.remote()
        finally:
            await handles[0].resume_engine.remote()
        return await task, moved, out

    got, moved, out = asyncio.run(run())
    assert "error" in moved and moved["method"] == "live" and not moved.get("refused"), moved
    assert out == {"out": [], "in": []}  # the source called the move off
    assert got.token_ids == want[0] and got.worker_id == "worker-0"
    deadline = time.monotonic() + 120
    while True:  # Ray restarts worker 1 (the killed incarnation may answer "died" meanwhile)
        try:
            ray.get(ray.get(cluster.workers.remote())[1].ping.remote(), timeout=30)
            break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            assert time.monotonic() < deadline, "worker 1 never came back"
            time.sleep(0.5)
    _wait_clean(cluster, [0, 1])  # (worker 2 was stopped for good above)
    _wait_no_inflight(cluster)


def test_pressured_worker_moves_running_streams_live(cluster, svc, smol_llm):
    """Worker 0's tiny pool parks streams of a burst: with rebalancing on (and parked streams
    left where they are), the planner moves running streams live to the workers with room,
    while worker 0 is held; every output is the unmoved one and the moves are counted as
    live rebalancing."""
    n = 6
    want = _reference(smol_llm, n)
    w0 = ray.get(cluster.workers.remote())[0]

    async def live_in() -> float:
        s = await cluster.server_info.remote()
        return sum(w["stats"]["migration_moved_in"] for w in s["workers"][1:])

    async def run() -> tuple[list[Result], dict[str, Any], dict[str, Any]]:
        await w0.pause_engine.remote()
        tasks: list[asyncio.Task] = []
        try:
            tasks, load = await _burst_parked_on_worker0(cluster, svc, w0, n, "rebalance")
            start = await live_in()
            await cluster.set_migration.remote(True, True, 1e9)  # running streams only
            try:
                await _until("the planner never moved a running stream", live_in,
                             lambda m: m > start)
            finally:
                await cluster.set_migration.remote(False, False, 0.5)
            held = await w0.load.remote()
        finally:
            await w0.resume_engine.remote()
        return await asyncio.gather(*tasks), load, held

    before = _engine_stats(cluster, 0)
    got, load, held = asyncio.run(run())
    assert held["running"] < load["running"], (load, held)  # streams left while it was held
    assert [r.token_ids for r in got] == want
    assert sum(r.worker_id != "worker-0" for r in got) >= 1
    assert _engine_stats(cluster, 0)["migration_moved_out"] > before["migration_moved_out"]
    _wait_clean(cluster, [0, 1])  # (worker 2 was stopped for good above)
    _wait_no_inflight(cluster)


def test_drain_hands_running_streams_over(cluster, svc, smol_llm):
    n = 8
    want = _reference(smol_llm, n)
    handles = ray.get(cluster.workers.remote())

    conv = svc.tokenize(prompt=" ".join(f"Line {k}: the keeper lit the lamp at dusk." for k in range(8)))
    short = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    first_prompt: list[int] = []

    async def run() -> tuple[list[Result], dict[str, Any]]:
        # an idle conversation on worker 0: the streams below push its blocks to host
        turn1 = await svc.complete(svc.build(conv, short, await _session_on_worker0(cluster, "conv")))
        assert turn1.worker_id == "worker-0"
        first_prompt.extend(conv)
        conv.extend(turn1.token_ids)
        session = await _session_on_worker0(cluster, "drain")
        # held, worker 0 takes all the streams before any can finish; stepped until they
        # push the conversation's cached blocks to host, it hands over streams mid-generation
        await handles[0].pause_engine.remote()
        tasks = [asyncio.create_task(_run(svc, i, session)) for i in range(n)]
        await _until("the streams never all reached worker 0", handles[0].load.remote,
                     lambda ld: ld["waiting"] == n)
        conv_first = hash_full_blocks(first_prompt, 16)[0]
        load = await handles[0].step_engine.remote()
        for _ in range(20):
            if conv_first in load["held"]["host"] and load["running"]:
                break
            load = await handles[0].step_engine.remote()
        assert conv_first in load["held"]["host"] and load["running"], load
        drained = await admin.drain(svc, "worker-0", 300.0)  # what DrainWorker runs
        return await asyncio.gather(*tasks), drained

    got, drained = asyncio.run(run())
    assert drained["drained"] and drained["worker_id"] == "worker-0", drained
    assert [r.token_ids for r in got] == want
    assert all(r.worker_id == "worker-1" for r in got)
    with pytest.raises(ray.exceptions.RayActorError):  # the drained worker exited for good
        ray.get(handles[0].ping.remote(), timeout=30)
    info = ray.get(cluster.server_info.remote())["workers"]
    assert info[0]["stats"]["drained"] == 1 and not info[0]["alive"]
    # the conversation followed its session: the next turn is a prefix hit on worker 1
    turn2 = conv + svc.tokenize(prompt=" And then?")
    stats1 = _stats(cluster)[1]
    assert drained["sessions_moved"] >= 2 and stats1["migration_session_blocks_in"] > 0
    nxt = asyncio.run(svc.complete(svc.build(turn2, short, "conv")))
    assert nxt.worker_id == "worker-1"
    # every full block of the first turn's prompt, which worker 1 never computed, came over
    assert nxt.usage[1] >= len(first_prompt) // 16 * 16
    deadline = time.monotonic() + 10  # the router's stats are those of its last poll
    while _stats(cluster)[1]["host_prefix_hit_tokens"] <= stats1["host_prefix_hit_tokens"]:
        assert time.monotonic() < deadline, "worker 1 served no prefix from its host tier"
        time.sleep(0.2)
    assert nxt.token_ids == smol_llm.generate(
        [turn2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    _wait_clean(cluster, [1])
    _wait_no_inflight(cluster)  # each request's router slot followed it and was given back
