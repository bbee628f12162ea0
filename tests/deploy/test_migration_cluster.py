"""Migration and drain on a cluster of its own (real Ray, two workers on the default model,
worker 0 with a tiny device KV pool), driven through the ingress's Service: parked streams
move to the worker with room and a drained worker hands its streams over, every output
identical to an unmoved run, no request failing, no KV left behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from kvserve.deploy.config import ServeConfig
from kvserve.deploy.service import Result, Service
from kvserve.router.config import RouterConfig
from kvserve.router.router import RouterActor
from kvserve.sampling import SamplingParams

ENGINE = {"num_threads": 1, "kv_cache_tokens": 4096, "max_model_len": 512, "max_num_seqs": 16,
          "host_cache_gib": 0.05}
TINY = {"kv_cache_tokens": 256, "admission_lookahead_tokens": 0}  # 16 blocks, greedy admission
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    own = not ray.is_initialized()
    if own:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    cfg = RouterConfig(num_workers=2, engine=ENGINE, num_cpus_per_worker=0.5,
                       max_imbalance=100, load_poll_interval_s=0.5, engine_overrides={0: TINY},
                       migration={"park_threshold_s": 0.5, "min_interval_s": 2.0})
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


async def _service(router: Any) -> Service:
    svc = Service(ServeConfig(num_workers=2, engine=ENGINE), router=router)
    await svc.start()
    return svc


async def _run(svc: Service, i: int, session: str) -> Result:
    req = svc.build(svc.tokenize(prompt=_prompt(i)),
                    {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}, session)
    return await svc.complete(req)


async def _session_on_worker0(router: Any, session: str) -> str:
    """Bind `session` to worker 0 (left alone, a new session goes to the emptier worker 1)."""
    pick = await router.pick.remote([], session, [1])
    assert pick["idx"] == 0
    router.release.remote(0)
    return session


def _stats(router: Any) -> list[dict[str, float]]:
    return [w["stats"] for w in ray.get(router.server_info.remote())["workers"]]


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


def test_parked_streams_move_to_the_worker_with_room(cluster, smol_llm):
    n = 6
    want = _reference(smol_llm, n)

    async def run() -> list[Result]:
        svc = await _service(cluster)
        session = await _session_on_worker0(cluster, "hot")
        return await asyncio.gather(*(_run(svc, i, session) for i in range(n)))

    before = _stats(cluster)
    got = asyncio.run(run())
    after = _stats(cluster)
    assert [r.token_ids for r in got] == want
    assert all(r.finish_reason == "length" and r.usage[2] == MAX_TOKENS for r in got)
    assert after[0]["evictions"] > before[0]["evictions"]  # the pressure parked streams
    moved = after[1]["migration_streams_in"] - before[1]["migration_streams_in"]
    assert moved >= 1 and after[1]["migration_bytes_in"] > before[1]["migration_bytes_in"]
    assert sum(r.worker_id == "worker-1" for r in got) >= 1  # finished where they moved
    _wait_clean(cluster, [0, 1])
    assert all(w["inflight"] == 0 for w in ray.get(cluster.server_info.remote())["workers"])


def test_drain_hands_running_streams_over(cluster, smol_llm):
    n = 8
    want = _reference(smol_llm, n)
    handles = ray.get(cluster.workers.remote())

    async def run() -> tuple[list[Result], dict[str, Any]]:
        svc = await _service(cluster)
        session = await _session_on_worker0(cluster, "drain")
        tasks = [asyncio.create_task(_run(svc, i, session)) for i in range(n)]
        deadline = time.monotonic() + 120
        while len(await handles[0].unfinished_ids.remote()) < n:
            assert time.monotonic() < deadline, "the streams never all reached worker 0"
            await asyncio.sleep(0.05)
        drained = await cluster.drain.remote(0, 300.0)
        return await asyncio.gather(*tasks), drained

    got, drained = asyncio.run(run())
    assert drained["drained"] and "error" not in drained, drained
    assert [r.token_ids for r in got] == want
    assert all(r.worker_id == "worker-1" for r in got)
    with pytest.raises(ray.exceptions.RayActorError):  # the drained worker exited for good
        ray.get(handles[0].ping.remote(), timeout=30)
    info = ray.get(cluster.server_info.remote())["workers"]
    assert info[0]["stats"]["drained"] == 1 and not info[0]["alive"]
    _wait_clean(cluster, [1])
    assert all(w["inflight"] == 0 for w in info)
