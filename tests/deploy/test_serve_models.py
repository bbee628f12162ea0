"""Two base models of different families behind one endpoint, through real Ray serving: an
app of its own beside the session's (the same Serve proxies) serving the default SmolLM2
GGUF (llama family) and a tiny random-weight Qwen2 model that transformers wrote, one worker
each, each under its own router.

A request's `model` picks the base model (none: the first); each answers with the greedy
tokens of kvserve's offline engine on that model alone, over gRPC and HTTP. ListModels,
/v1/models, GetServerInfo, /v1/server_info and /health show both models with their
workers; an unknown model is NOT_FOUND / 404, naming the models served, and a request a
model refuses is counted as that model's rejection. The operators' calls (move, drain) act
on the model they name. A redeploy without the second model stops its router."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest
import ray
from serve_fixtures import API_KEY
from tiny_models import make_tiny_hf_model

from kvserve import LLM, SamplingParams
from kvserve.deploy.app import build_app
from kvserve.deploy.config import ServeConfig
from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc
from kvserve.router.router import NAMESPACE

pytestmark = pytest.mark.slow  # an app of its own with two models, then one: ~3 min

APP = "kvserve-models"
ROUTER = "kvserve-models-router"
TINY = "tiny-qwen2"
ENGINE = {"num_threads": 1, "kv_cache_tokens": 2048, "max_model_len": 512, "max_num_seqs": 8}
PROMPT = "Once upon a time, in a land far away,"
N = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("models_serve"), "qwen2", seed=11)


@pytest.fixture(scope="module")
def models_app(serve_app, tiny) -> Any:
    from ray import serve

    from kvserve.router.lifecycle import kill_router

    cfg = ServeConfig(models=[{"model": tiny, "served_model_name": TINY}], num_workers=1,
                      num_cpus_per_worker=0.5, engine=ENGINE, api_keys=[API_KEY],
                      grpc_port=serve_app.grpc_port, http_port=serve_app.http_port,
                      router_name=ROUTER)
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    try:
        yield cfg
    finally:
        if APP in serve.status().applications:
            serve.delete(APP)
        for name in cfg.router_names():
            kill_router(name)


@pytest.fixture(scope="module")
def want(tiny, smol_llm) -> dict[str, list[int]]:
    """Each model's greedy tokens for PROMPT, from kvserve's offline engine on it alone."""
    p = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    out = {"base": smol_llm.generate(PROMPT, p)[0].token_ids,
           TINY: LLM(tiny, kv_cache_tokens=1024).generate(PROMPT, p)[0].token_ids}
    assert out["base"] != out[TINY]  # (so that each answer shows which model ran it)
    return out


def _stub(serve_app) -> tuple[grpc.Channel, Any, tuple]:
    ch = grpc.insecure_channel(serve_app.grpc_target)
    md = (("authorization", f"Bearer {API_KEY}"), ("application", APP))
    return ch, kvserve_pb2_grpc.KVServeStub(ch), md


def _http(serve_app, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{serve_app.http_url}/{APP}{path}", data=None if body is None else
        json.dumps(body).encode(), headers={"authorization": f"Bearer {API_KEY}",
                                            "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _rejected(serve_app, model: str) -> float:
    """ray_kvserve_requests_rejected_total{model, reason="invalid"} as Ray exports it now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{serve_app.metrics_port}/metrics",
                                timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("ray_kvserve_requests_rejected_total{")
               and f'model="{model}"' in line and 'reason="invalid"' in line)


def _wait_for(cond: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.5)


def test_requests_are_routed_by_model_over_grpc(serve_app, models_app, want):
    base = models_app.model_name()
    sampling = pb.SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    ch, kv, md = _stub(serve_app)
    with ch:
        listed = kv.ListModels(pb.ListModelsRequest(), metadata=md, timeout=60).models
        r_tiny = kv.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=sampling, model=TINY),
                             metadata=md, timeout=300)
        r_base = kv.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=sampling, model=base),
                             metadata=md, timeout=300)
        r_default = kv.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=sampling),
                                metadata=md, timeout=300)
        streamed = [c for c in kv.GenerateStream(pb.GenerateRequest(
            prompt=PROMPT, sampling=sampling, model=TINY), metadata=md, timeout=300)]
        tokenized = kv.Tokenize(pb.TokenizeRequest(prompt=PROMPT, model=TINY), metadata=md,
                                timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            kv.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=sampling, model="nope"),
                        metadata=md, timeout=60)
        info = kv.GetServerInfo(pb.GetServerInfoRequest(), metadata=md, timeout=60)
    assert [(m.id, m.parent) for m in listed] == [(base, ""), (TINY, "")]
    assert all(m.max_model_len == ENGINE["max_model_len"] for m in listed)
    assert (list(r_tiny.token_ids), r_tiny.model) == (want[TINY], TINY)
    assert (list(r_base.token_ids), r_base.model) == (want["base"], base)
    assert (list(r_default.token_ids), r_default.model) == (want["base"], base)
    assert [t for c in streamed for t in c.delta_token_ids] == want[TINY]
    assert {c.model for c in streamed} == {TINY}
    assert tokenized.count > 0
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert base in err.value.details() and TINY in err.value.details()
    # every model with its own workers; the top-level fields are the first model's
    assert info.model == base and [w.worker_id for w in info.workers] == ["worker-0"]
    assert [m.model for m in info.models] == [base, TINY]
    assert [m.root for m in info.models][1] == models_app.models[0].model
    for m in info.models:
        assert [(w.worker_id, w.alive) for w in m.workers] == [("worker-0", True)]
        assert m.max_model_len == ENGINE["max_model_len"]
    # each model's requests ran on its own router's worker
    routers = [ray.get_actor(n, namespace=NAMESPACE) for n in models_app.router_names()]
    for r in routers:
        (w,) = ray.get(r.workers.remote())
        assert ray.get(w.stats.remote())["tokens_computed"] > 0


def test_requests_are_routed_by_model_over_http(serve_app, models_app, want, tiny):
    base = models_app.model_name()
    status, models = _http(serve_app, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [base, TINY]
    assert [m["root"] for m in models["data"]][1] == tiny
    texts = {}
    for name in (TINY, base):
        status, r = _http(serve_app, "/v1/completions", {
            "model": name, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "ignore_eos": True})
        assert status == 200 and r["model"] == name, r
        texts[name] = r["choices"][0]["text"]
    assert texts[TINY] != texts[base]
    status, r = _http(serve_app, "/v1/chat/completions", {
        "model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert status == 200 and r["model"] == TINY, r
    status, r = _http(serve_app, "/v1/completions", {"model": "nope", "prompt": PROMPT})
    assert status == 404 and TINY in r["error"]["message"], r
    # a request the second model refuses is its rejection (the dashboard's `model`)
    status, r = _http(serve_app, "/v1/completions", {"model": TINY, "prompt": PROMPT,
                                                     "max_tokens": 100000})
    assert status == 400 and "max_model_len" in r["error"]["message"], r
    _wait_for(lambda: _rejected(serve_app, TINY) >= 1, "the rejection's series")
    status, info = _http(serve_app, "/v1/server_info")
    assert status == 200 and [m["model"] for m in info["models"]] == [base, TINY]
    assert all(len(m["workers"]) == 1 for m in info["models"])
    status, health = _http(serve_app, "/health")
    assert status == 200 and health == {"status": "ok", "workers_alive": 2,
                                        "models": {base: 1, TINY: 1}}


def test_operators_calls_act_on_the_model_they_name(serve_app, models_app):
    """Move and drain name a base model (none: the first): a stream of the second model is
    known to its router only; an unknown model is NOT_FOUND / 404."""
    import threading

    second = ray.get_actor(models_app.router_names()[1], namespace=NAMESPACE)
    (w,) = ray.get(second.workers.remote())
    ray.get(w.pause_engine.remote())  # the stream stays unfinished while the calls run
    ch, kv, md = _stub(serve_app)
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(kv.Generate(pb.GenerateRequest(
        prompt=PROMPT, model=TINY, sampling=pb.SamplingParams(
            temperature=0, max_tokens=N, ignore_eos=True)), metadata=md, timeout=300)))
    t.start()
    try:
        _wait_for(lambda: ray.get(w.unfinished_ids.remote()), "the stream on its worker")
        (rid,) = ray.get(w.unfinished_ids.remote())
        status, r = _http(serve_app, "/v1/admin/move", {"request_id": rid})
        assert status == 404 and "no unfinished request" in r["error"]["message"], r
        # its own router finds it (one worker: nowhere to move it)
        status, r = _http(serve_app, "/v1/admin/move", {"request_id": rid, "model": TINY})
        assert status == 409 and "no other worker" in r["error"]["message"], r
        with pytest.raises(grpc.RpcError) as err:
            kv.MoveStream(pb.MoveStreamRequest(request_id=rid, model=TINY), metadata=md,
                          timeout=60)
        assert "no other worker" in err.value.details()
        status, r = _http(serve_app, "/v1/admin/drain", {"worker": "worker-0", "model": "nope"})
        assert status == 404 and repr(TINY) in r["error"]["message"], r
        with pytest.raises(grpc.RpcError) as err:
            kv.DrainWorker(pb.DrainWorkerRequest(worker_id="worker-0", model="nope"),
                           metadata=md, timeout=60)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        ray.get(w.resume_engine.remote())
        t.join(300)
        ch.close()
    assert len(done) == 1 and len(done[0].token_ids) == N


def test_a_redeploy_without_a_model_stops_its_router(serve_app, models_app, want):
    """The app redeployed with its first model only: the other model's router (detached)
    and its worker are stopped, and the first model serves on."""
    from ray import serve

    from kvserve.router.lifecycle import find_router, worker_names

    dropped = models_app.router_names()[1]
    assert find_router(dropped) is not None
    one = models_app.model_copy(update={"models": []})
    serve.run(build_app(one), name=APP, route_prefix=f"/{APP}")
    assert find_router(dropped) is None and worker_names(dropped) == []
    status, models = _http(serve_app, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [one.model_name()]
    status, r = _http(serve_app, "/v1/completions", {"model": TINY, "prompt": PROMPT})
    assert status == 404, r
    ch, kv, md = _stub(serve_app)
    with ch:
        r = kv.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(
            temperature=0, max_tokens=N, ignore_eos=True)), metadata=md, timeout=300)
    assert list(r.token_ids) == want["base"]
