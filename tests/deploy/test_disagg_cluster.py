"""Disaggregated serving on a cluster of its own (real Ray: a router actor and three workers
on a tiny random Llama, two prefill and one decode), driven through the ingress's Service:
long prompts are prefilled on a prefill worker and decoded on the decode worker, short ones
prefilled there, with the tokens the same workers give as mixed workers; a prefill worker
killed mid-prompt has its request retried on the other; a decode worker without room takes
the request into its own queue; a failed hand-off is recomputed or fails the request, by
the policy; nothing stays reserved or held. Workers whose KV cannot be exchanged are
refused at start. The decode worker computes none of a handed-off prompt; one killed
during a hand-off strands nothing. The tests run in order (two kill a worker).

No test relies on timing for the state it checks: engines are held (paused) while a state
must last, and the hand-off's failures are injected (`fail_commits`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from serve_fixtures import ray_started
from tiny_models import tiny_model_path

from kvserve.deploy.config import ServeConfig
from kvserve.deploy.errors import ServiceError
from kvserve.deploy.service import Result, Service
from kvserve.router.config import RouterConfig
from kvserve.router.router import RouterActor

pytestmark = pytest.mark.slow  # a router and three workers of its own

ENGINE = {"num_threads": 1, "kv_cache_tokens": 2048, "max_model_len": 512, "max_num_seqs": 16,
          "host_cache_gib": 0.05}
ROLES = ["prefill", "prefill", "decode"]
MAX_TOKENS = 16
DISAGG_LEASE_S = 60.0  # reservations and held streams: a failure must end sooner than this
DISAGG = {"min_prompt_tokens": 32, "local_prefix_share": 2.0,  # (the prefix rule off)
          "lease_s": DISAGG_LEASE_S}


def _prompt(i: int, long: bool = True) -> str:
    if not long:
        return f"Tale {i}: a cat"
    return (f"Log {i}: " + " ".join(f"ship {i}-{k} came into the harbour at dawn"
                                    for k in range(6)))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(model) -> Iterator[Any]:
    own = not ray.is_initialized()
    if own:
        ray_started(lambda: ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False))
    cfg = RouterConfig(num_workers=3, engine={**ENGINE, "model": model},
                       num_cpus_per_worker=0.5, max_imbalance=100, load_poll_interval_s=0.5,
                       migration={"enabled": False}, roles=ROLES, disagg=DISAGG)
    router = ray.remote(RouterActor).options(num_cpus=0, max_concurrency=1000).remote(
        cfg.to_dict())
    ray.get(router.ready.remote())
    try:
        yield router
    finally:
        ray.kill(router)
        if own:
            ray.shutdown()


@pytest.fixture(scope="module")
def svc(cluster, model) -> Service:
    s = Service(ServeConfig(model=model, prefill_workers=2, decode_workers=1, engine=ENGINE),
                router=cluster)
    asyncio.run(s.start())
    return s


def _request(svc: Service, prompt: str, rid: str | None = None):
    return svc.build(svc.tokenize(prompt=prompt),
                     {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}, None, rid)


async def _run(svc: Service, prompt: str, rid: str | None = None) -> Result:
    return await svc.complete(_request(svc, prompt, rid))


@pytest.fixture(scope="module")
def refs(cluster, svc) -> dict[str, list[int]]:
    """Every prompt's tokens on the same workers as mixed workers (colocated)."""
    prompts = [_prompt(i) for i in range(6)] + [_prompt(i, False) for i in range(2)]
    ray.get(cluster.set_roles.remote(["mixed"] * 3))
    try:
        async def run() -> list[Result]:
            return [await _run(svc, p) for p in prompts]

        got = asyncio.run(run())
    finally:
        ray.get(cluster.set_roles.remote(ROLES))
    assert all(r.prefill_worker_id == r.worker_id for r in got)
    return {p: r.token_ids for p, r in zip(prompts, got, strict=True)}


def _info(cluster: Any) -> dict[str, Any]:
    return ray.get(cluster.server_info.remote())


def _wait_clean(cluster: Any) -> None:
    """No KV used, nothing reserved, held or moving on any worker, no slot counted, and the
    router has seen it (its next picks count on every worker's room)."""
    deadline = time.monotonic() + 60
    while True:
        handles = ray.get(cluster.workers.remote())
        try:
            state = [(ray.get(h.load.remote())["stats"]["kv_blocks_used"],
                      ray.get(h.handoffs.remote()), ray.get(h.live_moves.remote()))
                     for h in handles]
        except ray.exceptions.RayActorError:  # (a killed worker still restarting)
            state = None
        seen = _info(cluster)["workers"]
        inflight = [w["inflight"] for w in seen]
        full = all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in seen)
        if state is not None and full and not any(inflight) and all(
                used == 0 and held == {"prefilling": [], "held": []}
                and moves == {"out": [], "in": []} for used, held, moves in state):
            return
        assert time.monotonic() < deadline, (state, inflight)
        time.sleep(0.25)


def _handoffs_since(cluster: Any, n: int, count: int) -> list[dict[str, Any]]:
    """The hand-offs logged after the first `n`, once there are `count` of them (the router
    logs one when it ended, which may be just after its client's last token)."""
    deadline = time.monotonic() + 30
    while True:
        log = ray.get(cluster.handoff_log.remote())
        if len(log) - n >= count:
            return log[n:]
        assert time.monotonic() < deadline, log[n:]
        time.sleep(0.05)


def test_long_prompts_are_handed_off_and_short_ones_prefilled_locally(cluster, svc, refs):
    before = _info(cluster)["disagg"]
    logged = len(ray.get(cluster.handoff_log.remote()))
    prompts = [_prompt(i) for i in range(4)] + [_prompt(i, False) for i in range(2)]

    async def run() -> list[Result]:
        return list(await asyncio.gather(*(_run(svc, p) for p in prompts)))

    got = asyncio.run(run())
    assert [r.token_ids for r in got] == [refs[p] for p in prompts]
    for r in got[:4]:
        assert r.prefill_worker_id in ("worker-0", "worker-1") and r.worker_id == "worker-2"
        assert r.usage[2] == MAX_TOKENS
    assert all(r.prefill_worker_id == r.worker_id == "worker-2" for r in got[4:])
    log = _handoffs_since(cluster, logged, 4)
    assert all(e["outcome"] == "moved" and e["bytes"] > 0 and e["seconds"] > 0 for e in log)
    after = _info(cluster)["disagg"]
    assert after["handoffs"].get("moved", 0) - before["handoffs"].get("moved", 0) == 4
    assert after["local_prefills"]["short_prompt"] - before["local_prefills"].get(
        "short_prompt", 0) == 2
    _wait_clean(cluster)


def test_a_prefill_worker_killed_mid_prompt_is_retried_on_the_other(cluster, svc, refs):
    """Both prefill engines held; the request reaches one, which is killed before its first
    token: the ingress retries it, the router calls off the first hand-off (its reservation
    freed) and the other prefill worker runs the prompt."""
    handles = ray.get(cluster.workers.remote())
    prompt = _prompt(4)
    logged = len(ray.get(cluster.handoff_log.remote()))

    async def run() -> tuple[Result, int]:
        await asyncio.gather(*(handles[i].pause_engine.remote() for i in (0, 1)))
        task = asyncio.create_task(_run(svc, prompt, "killed-mid-prompt"))
        deadline = time.monotonic() + 60
        while True:
            on = [i for i in (0, 1)
                  if "killed-mid-prompt" in await handles[i].unfinished_ids.remote()]
            if on:
                break
            assert time.monotonic() < deadline, "the request reached no prefill worker"
            await asyncio.sleep(0.05)
        victim = on[0]
        await handles[1 - victim].resume_engine.remote()
        ray.kill(handles[victim], no_restart=False)  # Ray restarts it, empty
        return await asyncio.wait_for(task, 120), victim

    r, victim = asyncio.run(run())
    assert r.token_ids == refs[prompt]
    assert r.prefill_worker_id == f"worker-{1 - victim}" and r.worker_id == "worker-2"
    assert svc.retries >= 1
    outcomes = [e["outcome"] for e in _handoffs_since(cluster, logged, 2)]
    assert outcomes == ["gone", "moved"], outcomes
    deadline = time.monotonic() + 120
    while not all(w["alive"] for w in _info(cluster)["workers"]):
        assert time.monotonic() < deadline, "the killed worker did not come back"
        time.sleep(0.25)
    _wait_clean(cluster)


def test_a_decode_worker_without_room_takes_the_request_into_its_queue(cluster, svc, refs):
    """The decode worker's pool is taken (a reservation of its own); once the router has
    seen it, a long prompt is not handed off (no room to reserve) but queued on the decode
    worker, where it runs once room comes back."""
    handles = ray.get(cluster.workers.remote())
    dec = handles[2]
    kv = ray.get(handles[0].info.remote())["kv"]
    bs = kv["block_size"]
    hogs: list[str] = []

    def hog(blocks: int) -> None:  # a reservation of `blocks` blocks (at most a context's)
        rid = f"hog{len(hogs)}"
        info = {"request_id": rid, "tokens": blocks * bs - 1, "max_len": blocks * bs,
                "block_size": bs, "model": kv["model"], "dtype": kv["dtype"],
                "bytes_per_block": 0}
        assert "error" not in ray.get(dec.live_reserve.remote(info, 0, 600.0))
        hogs.append(rid)

    prompt = _prompt(5)
    before = _info(cluster)["disagg"]["local_prefills"].get("no_room", 0)
    try:
        while (free := ray.get(dec.load.remote())["kv_blocks_free"]) > 2:
            hog(min(free - 2, ENGINE["max_model_len"] // bs))
        deadline = time.monotonic() + 30
        while _info(cluster)["workers"][2]["kv_blocks_free"] > 2:  # a poll has seen it
            assert time.monotonic() < deadline
            time.sleep(0.1)

        async def run() -> Result:
            task = asyncio.create_task(_run(svc, prompt, "no-room"))
            deadline = time.monotonic() + 60
            while "no-room" not in await dec.unfinished_ids.remote():
                assert time.monotonic() < deadline, "the request did not reach the decode worker"
                await asyncio.sleep(0.05)
            assert (await dec.load.remote())["waiting"] == 1  # it waits for room there
            for h in hogs:  # room comes back
                await dec.live_cancel.remote(h)
            return await asyncio.wait_for(task, 120)

        r = asyncio.run(run())
    finally:
        for h in hogs:
            ray.get(dec.live_cancel.remote(h))
    assert r.token_ids == refs[prompt] and r.prefill_worker_id == r.worker_id == "worker-2"
    assert _info(cluster)["disagg"]["local_prefills"]["no_room"] - before == 1
    _wait_clean(cluster)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_handoff_is_recomputed_or_fails_the_request(cluster, svc, refs, policy):
    """The decode worker's commit fails (injected): under `recompute` the stream's state goes
    there without its KV and is recomputed, the tokens unchanged; under `fail` the client
    gets its first token, then UNAVAILABLE. Nothing stays reserved or held either way."""
    handles = ray.get(cluster.workers.remote())
    prompt = _prompt(1)
    logged = len(ray.get(cluster.handoff_log.remote()))
    old = ray.get(cluster.set_disagg.remote(failure_policy=policy))
    ray.get(handles[2].fail_commits.remote(1))
    try:
        async def run() -> tuple[list[dict], BaseException | None]:
            chunks: list[dict] = []
            try:
                async for c in svc.stream(_request(svc, prompt)):
                    chunks.append(c)
            except ServiceError as e:
                return chunks, e
            return chunks, None

        chunks, err = asyncio.run(run())
    finally:
        ray.get(cluster.set_disagg.remote(**old))
        ray.get(handles[2].fail_commits.remote(0))
    (outcome,) = _handoffs_since(cluster, logged, 1)
    tokens = [t for c in chunks for t in c["token_ids"]]
    if policy == "recompute":
        assert err is None and tokens == refs[prompt]
        assert outcome["outcome"] == "recomputed" and "injected fault" in outcome["error"]
        assert chunks[-1]["worker_id"] == "worker-2"
    else:
        assert err is not None and err.kind == "unavailable" and "hand-off" in err.message
        assert tokens == refs[prompt][:1]  # the first token came, then the error
        assert outcome["outcome"] == "failed"
    _wait_clean(cluster)


def test_the_decode_worker_never_prefills_a_handed_off_prompt(cluster, svc, refs):
    """The KV came with the stream: the decode worker runs one token per decode step of a
    handed-off request (the first token in, then its own), none of its prompt."""
    _wait_clean(cluster)
    dec = ray.get(cluster.workers.remote())[2]
    prompt = _prompt(2)
    before = ray.get(dec.load.remote())["stats"]
    r = asyncio.run(_run(svc, prompt))
    _wait_clean(cluster)
    after = ray.get(dec.load.remote())["stats"]
    assert r.token_ids == refs[prompt] and r.worker_id == "worker-2"
    assert r.prefill_worker_id in ("worker-0", "worker-1")
    assert after["tokens_computed"] - before["tokens_computed"] == MAX_TOKENS - 1
    assert after["tokens_recomputed"] == before["tokens_recomputed"]
    assert after["handoffs_in"] - before["handoffs_in"] == 1


def test_a_decode_worker_killed_during_a_handoff_strands_nothing(cluster, svc, refs):
    """The decode worker dies while the prompt runs on a prefill worker (held paused): the
    commit finds no reservation there (dead, or restarted empty) and, under `fail`, the
    client gets its first token then UNAVAILABLE; nothing stays held on the prefill worker
    and the restarted decode worker serves again. No call waits for a lease."""
    handles = ray.get(cluster.workers.remote())
    prompt = _prompt(3)
    logged = len(ray.get(cluster.handoff_log.remote()))
    old = ray.get(cluster.set_disagg.remote(failure_policy="fail"))
    try:
        async def run() -> tuple[list[dict], BaseException | None, float]:
            await asyncio.gather(*(handles[i].pause_engine.remote() for i in (0, 1)))
            chunks: list[dict] = []

            async def read() -> BaseException | None:
                try:
                    async for c in svc.stream(_request(svc, prompt, "decode-killed")):
                        chunks.append(c)
                except ServiceError as e:
                    return e
                return None

            task = asyncio.create_task(read())
            deadline = time.monotonic() + 60
            while not (on := [i for i in (0, 1) if "decode-killed"
                              in await handles[i].unfinished_ids.remote()]):
                assert time.monotonic() < deadline, "the request reached no prefill worker"
                await asyncio.sleep(0.05)
            ray.kill(handles[2], no_restart=False)  # Ray restarts it, empty
            t0 = time.monotonic()
            await asyncio.gather(*(handles[i].resume_engine.remote() for i in (0, 1)))
            err = await asyncio.wait_for(task, 120)
            assert on[0] in (0, 1)
            return chunks, err, time.monotonic() - t0

        chunks, err, took = asyncio.run(run())
    finally:
        ray.get(cluster.set_disagg.remote(**old))
    assert err is not None and err.kind == "unavailable", err
    assert [t for c in chunks for t in c["token_ids"]] == refs[prompt][:1]
    (outcome,) = _handoffs_since(cluster, logged, 1)
    assert outcome["outcome"] == "failed", outcome
    assert took < DISAGG_LEASE_S, took  # ended by the failed commit, not by a lease
    deadline = time.monotonic() + 120
    while not all(w["alive"] for w in _info(cluster)["workers"]):
        assert time.monotonic() < deadline, "the killed decode worker did not come back"
        time.sleep(0.25)
    _wait_clean(cluster)
    r = asyncio.run(_run(svc, prompt))  # the restarted decode worker takes hand-offs again
    assert r.token_ids == refs[prompt] and r.worker_id == "worker-2"
    _wait_clean(cluster)


def test_workers_whose_kv_cannot_be_exchanged_are_refused_at_start(cluster, model):
    """A decode worker with another KV block size than its prefill worker: the router's
    start fails naming both, and their start-up state says why. (On the module's Ray, whose
    CPUs hold its cluster's workers and the session app's: a quarter CPU each fits beside.)"""
    cfg = RouterConfig(num_workers=2, engine={**ENGINE, "model": model},
                       num_cpus_per_worker=0.25, migration={"enabled": False},
                       roles=["prefill", "decode"], engine_overrides={1: {"block_size": 32}})
    router = ray.remote(RouterActor).options(num_cpus=0, max_concurrency=100).remote(
        cfg.to_dict())
    try:
        with pytest.raises(ray.exceptions.RayTaskError,
                           match="worker-0 \\(prefill\\) and worker-1 \\(decode\\) cannot "
                                 "exchange KV: KV block size 16 vs 32"):
            # both workers answer first: one waiting for CPUs (others' actors hold them)
            # would join later and be refused alone (router._refuse_unexchangeable), not fail it
            ray.get(router.ready.remote(True))
        states = [w["state"] for w in ray.get(router.server_info.remote())["workers"]]
        assert all(s.startswith("failed: ") and "block size" in s for s in states), states
    finally:
        ray.kill(router)
