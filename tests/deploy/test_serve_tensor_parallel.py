"""A tensor-parallel worker through real Ray serving: an app of its own beside the session's
(its own router, the same Serve proxies) whose one worker spans two CPU ranks of a tiny model
with one KV head.

It answers gRPC requests with the single-device engine's greedy tokens, from a placement
group packed on one node, and GetServerInfo reports its size and devices. A rank process
killed while a stream runs there makes the worker a dead worker: the stream ends with
UNAVAILABLE after the tokens it had, Ray restarts the worker (new ranks, the old one gone),
and the next request is served by it."""

from __future__ import annotations

import time
from typing import Any

import grpc
import psutil
import pytest
import ray
from serve_fixtures import API_KEY
from tiny_models import make_tiny_hf_model

from kvserve import LLM, SamplingParams
from kvserve.deploy.app import build_app
from kvserve.deploy.config import ServeConfig
from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc
from kvserve.router.router import NAMESPACE, worker_actor_name

APP = "kvserve-tp"
ROUTER = "kvserve-tp-router"
ENGINE = {"num_threads": 2, "kv_cache_tokens": 1024, "max_model_len": 512, "max_num_seqs": 8}
PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tp_serve"), "llama", seed=3,
                              num_key_value_heads=1)


@pytest.fixture(scope="module")
def tp_app(serve_app, model) -> Any:
    from ray import serve

    from kvserve.router.lifecycle import kill_router

    cfg = ServeConfig(model=model, num_workers=1, num_cpus_per_worker=0.5, tensor_parallel_size=2,
                      engine=ENGINE, api_keys=[API_KEY], grpc_port=serve_app.grpc_port,
                      http_port=serve_app.http_port, router_name=ROUTER)
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    try:
        yield ray.get_actor(ROUTER, namespace=NAMESPACE)
    finally:
        if APP in serve.status().applications:
            serve.delete(APP)
        kill_router(ROUTER)


def stub(serve_app) -> tuple[grpc.Channel, Any, tuple]:
    ch = grpc.insecure_channel(serve_app.grpc_target)
    md = (("authorization", f"Bearer {API_KEY}"), ("application", APP))
    return ch, kvserve_pb2_grpc.KVServeStub(ch), md


def greedy(n: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_a_tensor_parallel_worker_answers(serve_app, tp_app, model):
    want = LLM(model, kv_cache_tokens=1024).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    ch, kv, md = stub(serve_app)
    with ch:
        r = kv.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=greedy(12)), metadata=md,
                        timeout=300)
        info = kv.GetServerInfo(pb.GetServerInfoRequest(), metadata=md, timeout=60)
    assert list(r.token_ids) == want and r.worker_id == "worker-0"
    (w,) = info.workers
    assert w.tensor_parallel_size == 2 and list(w.devices) == ["cpu", "cpu"]
    (worker,) = ray.get(tp_app.workers.remote())
    stats = ray.get(worker.stats.remote())
    assert stats["tensor_parallel_size"] == 2 and stats["tp_collectives"] > 0
    # its devices are one placement group, packed on one node
    name = worker_actor_name(ROUTER, 0) + "-devices"
    (group,) = [g for g in ray.util.placement_group_table().values() if g["name"] == name]
    assert group["state"] == "CREATED" and group["strategy"] == "STRICT_PACK"


def _gone(pid: int) -> bool:
    """Exited (a zombie until its parent, the worker, reaps it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(cond: Any, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.slow  # the heavy tier: a worker restart (its ranks load again)
def test_a_killed_rank_makes_a_dead_worker(serve_app, tp_app):
    (worker,) = ray.get(tp_app.workers.remote())
    old = ray.get(worker.info.remote())
    (rank1,) = old["shard_pids"]
    ch, kv, md = stub(serve_app)
    with ch:
        ray.get(worker.pause_engine.remote())  # the stream advances only when stepped here
        call = kv.GenerateStream(pb.GenerateRequest(prompt=PROMPT, sampling=greedy(200)),
                                 metadata=md, timeout=600)
        _wait(lambda: ray.get(worker.unfinished_ids.remote()), "the stream reached its worker")
        ray.get(worker.step_engine.remote())  # the prompt, and the first token
        first = next(call)
        assert len(first.delta_token_ids) == 1
        psutil.Process(rank1).kill()
        _wait(lambda: _gone(rank1), "rank 1 is gone")
        # the next step meets the dead rank: the engine fails, the worker process exits
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.step_engine.remote(), timeout=120)
        with pytest.raises(grpc.RpcError) as ei:
            for _ in call:
                pass
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker worker-0 died mid-stream after 1 tokens" in ei.value.details()
        # Ray restarts it with new ranks; the router notices, and it serves again
        _wait(lambda: ray.get(tp_app.server_info.remote())["workers"][0]["alive"]
              and ray.get(tp_app.server_info.remote())["workers"][0]["restarts"] == 1,
              "the worker came back")
        r = kv.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=greedy(4)), metadata=md,
                        timeout=300)
        assert r.usage.completion_tokens == 4
    new = ray.get(worker.info.remote())
    assert new["incarnation"] != old["incarnation"] and new["shard_pids"] != old["shard_pids"]
    assert not any(_gone(p) for p in new["shard_pids"]) and _gone(rank1)
