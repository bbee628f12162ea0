"""The router outlives the ingress: killing the ingress replica leaves the router and its
workers running, and the replacement replica serves with them. A router is replaced only by a
deployment with a different configuration (one that changes only the worker count resizes
it), and `kill_router` leaves none of its actors alive."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc


def _complete(app, timeout: float = 60) -> str:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 6,
                       "temperature": 0}).encode()
    req = urllib.request.Request(app.http_url + "/v1/completions", data=body, headers={
        "content-type": "application/json", "authorization": f"Bearer {app.api_key}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _incarnations(app) -> list[str]:
    import ray

    return [ray.get(w.info.remote())["incarnation"] for w in app.workers()]


def _ingress_replica() -> tuple[str, str]:
    from ray.util import list_named_actors

    names = [a for a in list_named_actors(all_namespaces=True)
             if "KVServeIngress" in a["name"] and "REPLICA" in a["name"].upper()]
    assert len(names) == 1, names
    return names[0]["name"], names[0]["namespace"]


def _wait_dead(*methods) -> None:
    """Each actor method's actor is dead within a minute (its calls raise RayActorError)."""
    import ray
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + 60
    for m in methods:
        while True:
            try:
                ray.get(m.remote(), timeout=30)
            except RayActorError:
                break
            assert time.monotonic() < deadline, f"{m} still answers a minute after the kill"
            time.sleep(0.5)


def test_router_and_workers_survive_an_ingress_restart(serve_app):
    import ray

    from kvserve.router.lifecycle import find_router

    serve_app.wait_all_alive()
    before_text = _complete(serve_app)
    router_id = find_router()._actor_id
    incarnations = _incarnations(serve_app)
    restarts = [w["restarts"] for w in serve_app.server_info()["workers"]]
    name, ns = _ingress_replica()
    ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)

    deadline, text = time.monotonic() + 600, None  # Serve notices, then starts a new replica
    while text is None:
        try:
            text = _complete(serve_app, timeout=30)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            assert time.monotonic() < deadline, "no answer 10 minutes after the ingress died"
            time.sleep(1.0)
    assert text == before_text
    assert _ingress_replica()[0] != name  # a new replica answered
    assert find_router()._actor_id == router_id
    assert _incarnations(serve_app) == incarnations  # the same worker processes, not restarted
    assert [w["restarts"] for w in serve_app.server_info()["workers"]] == restarts
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        r = kvserve_pb2_grpc.KVServeStub(ch).Generate(pb.GenerateRequest(
            prompt="The capital of France is", sampling=pb.SamplingParams(
                max_tokens=6, temperature=0)), metadata=serve_app.metadata, timeout=120)
    assert r.text == before_text


@pytest.mark.slow
def test_router_is_reused_for_its_config_replaced_for_another_and_killed(serve_app):
    """A second router (its own name, one worker) beside the app's: the same configuration
    finds it again, one that changes only the worker count resizes it, another one replaces
    it and its workers; kill_router leaves nothing."""
    import ray

    from kvserve.router.lifecycle import find_router, get_or_create_router, kill_router
    from kvserve.router.lifecycle import worker_names as names
    from kvserve.router.router import NAMESPACE

    name = "kvserve-router-lifetime-test"
    w0 = f"{name}-worker-0"  # its worker's Ray actor name
    cfg = dataclasses.replace(serve_app.config.router_config(), num_workers=1)
    first = get_or_create_router(cfg, name=name)
    try:
        ray.get(first.ready.remote(), timeout=600)
        worker = ray.get(first.workers.remote())[0]
        assert names(name) == [w0]
        assert ray.get_actor(w0, namespace=NAMESPACE)._actor_id == worker._actor_id
        same = get_or_create_router(dataclasses.replace(cfg), name=name)
        assert same._actor_id == first._actor_id

        # only the worker count differs: resized, not replaced (up adds worker-1, down
        # drains it and it exits; worker-0 stays the same process throughout)
        grown = get_or_create_router(dataclasses.replace(cfg, num_workers=2), name=name)
        assert grown._actor_id == first._actor_id
        # worker-1 has loaded the model (a plain ready() of a router that served before does
        # not wait for workers a resize or the autoscaler adds: they join once loaded)
        ray.get(grown.ready.remote(True), timeout=600)
        added = ray.get(grown.workers.remote())
        assert len(added) == 2 and added[0]._actor_id == worker._actor_id
        ws = ray.get(grown.server_info.remote())["workers"]
        assert all(w["alive"] for w in ws), [(w["worker_id"], w["alive"], w.get("state")) for w in ws]
        shrunk = get_or_create_router(dataclasses.replace(cfg, num_workers=1), name=name)
        assert shrunk._actor_id == first._actor_id
        _wait_dead(added[1].info)
        assert ray.get(worker.info.remote())["worker_id"] == "worker-0"
        assert names(name) == [w0]  # the drained worker's name went with it

        other = get_or_create_router(dataclasses.replace(cfg, max_imbalance=7), name=name)
        assert other._actor_id != first._actor_id
        _wait_dead(first.config_digest, worker.info)  # its worker died with it
        ray.get(other.ready.remote(), timeout=600)
        new_worker = ray.get(other.workers.remote())[0]
        # the new router's worker took the name its predecessor's worker had
        assert ray.get_actor(w0, namespace=NAMESPACE)._actor_id == new_worker._actor_id
    finally:
        kill_router(name)
    assert find_router(name) is None and names(name) == []
    _wait_dead(other.config_digest, new_worker.info)  # neither is left running
    assert serve_app.server_info()["workers"]  # the app's own router was left alone
