"""Scaling down through Serve and deleting the app, with requests in flight.

An app of its own (its own router name, beside the session's shared app, on the same Serve
proxies): redeploying it with `num_workers` 2 -> 1 while 8 gRPC streams run on worker 1
drains worker 1 (its streams move to worker 0 and finish there with the outputs of an
undisturbed greedy run; none fails; worker 1 exits; worker 0 holds no KV afterwards).
When an ingress replica stops (replaced by a redeploy, or its app deleted) while streams
run, those that finish within its `shutdown_grace_s` finish, and the others end at that
point with UNAVAILABLE."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import ray
from serve_fixtures import API_KEY

from kvserve.deploy.app import build_app
from kvserve.deploy.config import ServeConfig
from kvserve.deploy.serve_cli import stop_app
from kvserve.deploy.shutdown import STOPPING
from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc
from kvserve.router.router import NAMESPACE
from kvserve.sampling import SamplingParams

pytestmark = pytest.mark.slow  # the heavy tier (README: the two commands)

APP = "kvserve-scale"
ROUTER = "kvserve-router-scale"
ENGINE = {"num_threads": 1, "kv_cache_tokens": 4096, "max_model_len": 1024, "max_num_seqs": 16}
MAX_TOKENS = 64  # worker 1 is held until the redeploy drains it: no length need outlast it
N = 8


def _cfg(serve_app, workers: int, grace_s: float = 120) -> ServeConfig:
    return ServeConfig(num_workers=workers, num_cpus_per_worker=0.5, engine=ENGINE,
                       api_keys=[API_KEY], grpc_port=serve_app.grpc_port,
                       http_port=serve_app.http_port, max_imbalance=100, router_name=ROUTER,
                       shutdown_grace_s=grace_s)


def _deploy(serve_app, workers: int, grace_s: float = 120) -> None:
    from ray import serve

    serve.run(build_app(_cfg(serve_app, workers, grace_s)), name=APP, route_prefix=f"/{APP}")


def _prompt(i: int) -> str:
    return f"Tale {i}: long ago, on an island far to the north, a fisher named Odd{i} saw"


class Streams:
    """Greedy gRPC streams to the app, each in a thread: its tokens, last worker, error."""

    def __init__(self, target: str, n: int, max_tokens: int | list[int], session: str) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.workers = [""] * n
        self.finish = [""] * n
        self.ended = [0.0] * n  # monotonic time each stream ended
        self.errors: list[str] = []
        self._ch = grpc.insecure_channel(target)
        stub = kvserve_pb2_grpc.KVServeStub(self._ch)
        md = (("authorization", f"Bearer {API_KEY}"), ("application", APP))
        lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n

        def run(i: int) -> None:
            sampling = pb.SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
            try:
                for c in stub.GenerateStream(pb.GenerateRequest(
                        prompt=_prompt(i), sampling=sampling, session_id=session,
                        request_id=f"{session}-{i}"), metadata=md, timeout=900):
                    self.tokens[i].extend(c.delta_token_ids)
                    self.workers[i], self.finish[i] = c.worker_id, c.finish_reason
            except grpc.RpcError as e:
                self.errors.append(f"{i}: {e.code().name} {e.details()}")
            self.ended[i] = time.monotonic()

        self.threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join(900)
        self._ch.close()


def _reference(smol_llm, n: int, max_tokens: int) -> list[list[int]]:
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in smol_llm.generate([_prompt(i) for i in range(n)], p)]


def _wait(cond: Any, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def scale_app(serve_app) -> Any:
    from ray import serve

    from kvserve.router.lifecycle import kill_router

    _deploy(serve_app, 2)
    try:
        yield ray.get_actor(ROUTER, namespace=NAMESPACE)
    finally:
        if APP in serve.status().applications:
            serve.delete(APP)
        kill_router(ROUTER)


def test_scaling_down_drains_the_removed_worker(serve_app, scale_app, smol_llm):
    router = scale_app
    handles = ray.get(router.workers.remote())
    pick = ray.get(router.pick.remote([], "scale", [0]))  # the session lives on worker 1
    assert pick["idx"] == 1
    ray.get(router.release.remote(1, pick["slot_id"]))

    # worker 1's engine is held: the streams reach it, make their first token in one step
    # (admitted together), and cannot end before the redeploy drains them
    ray.get(handles[1].pause_engine.remote())
    streams = Streams(serve_app.grpc_target, N, MAX_TOKENS, "scale")
    _wait(lambda: len(ray.get(handles[1].unfinished_ids.remote())) == N,
          "the streams never all reached worker 1")
    ray.get(handles[1].step_engine.remote())
    _wait(lambda: all(streams.tokens), "the streams' first tokens never came")
    _deploy(serve_app, 1)  # what a user does: the same app, redeployed with one worker
    want = _reference(smol_llm, N, MAX_TOKENS)  # meanwhile the streams go on on worker 0
    streams.join()

    assert not streams.errors, streams.errors
    assert streams.tokens == want
    assert streams.finish == ["length"] * N and streams.workers == ["worker-0"] * N
    _wait(lambda: ray.get(router.server_info.remote())["workers"][1]["stats"]["drained"] == 1,
          "worker 1 was never drained")
    info = ray.get(router.server_info.remote())["workers"]
    assert info[0]["stats"]["migration_streams_in"] == N  # every stream moved, none restarted
    assert not info[1]["alive"]
    with pytest.raises(ray.exceptions.RayActorError):  # the removed worker exited
        ray.get(handles[1].ping.remote(), timeout=60)

    def clean() -> bool:
        ld = ray.get(handles[0].load.remote())
        return (ld["stats"]["kv_blocks_used"] == 0 and ld["parked"] == ld["running"]
                == ld["waiting"] == 0 and ld["streams"] == 0)

    _wait(clean, "KV left behind on worker 0", 60)
    _wait(lambda: all(w["inflight"] == 0 for w in ray.get(router.server_info.remote())["workers"]),
          "router slots left behind", 30)
    # the same configuration again finds the resized router as it is
    from kvserve.router.lifecycle import get_or_create_router

    assert get_or_create_router(_cfg(serve_app, 1).router_config(), ROUTER)._actor_id \
        == router._actor_id


def _ingress_replicas() -> set[str]:
    from ray.serve.context import _get_global_client

    app = _get_global_client().get_serve_details().get("applications", {}).get(APP) or {}
    return {r["replica_id"] for d in app.get("deployments", {}).values()
            for r in d.get("replicas", ()) if r.get("state") not in STOPPING}


def _stopping(old: set[str]) -> bool:
    """Whether Serve is stopping the app's replicas `old` (the app deleted, or replaced)."""
    from ray.serve.context import _get_global_client

    app = _get_global_client().get_serve_details().get("applications", {}).get(APP)
    if app is None or app.get("status") == "DELETING":
        return True
    return not old & _ingress_replicas()


def test_a_stopping_ingress_gives_requests_its_grace_period(serve_app, scale_app, smol_llm):
    """Its replica replaced by a redeploy, then the app deleted: each time the short stream
    finishes during the shutdown, and the long one ends with UNAVAILABLE once the stopping
    replica's grace period is over. The worker is held and stepped by hand: the short stream
    runs only once the replica is stopping, the long one never ends by itself."""
    _deploy(serve_app, 1, grace_s=10)  # a redeploy that keeps the router (same configuration)
    short, long = 16, 900
    want = _reference(smol_llm, 1, short)
    rounds = (("replaced", 10, lambda: _deploy(serve_app, 1, grace_s=12)),
              ("deleted", 12, lambda: stop_app(APP, 300)))
    worker = ray.get(scale_app.workers.remote())[0]
    for what, grace, stop in rounds:
        ray.get(worker.pause_engine.remote())
        try:
            streams = Streams(serve_app.grpc_target, 2, [short, long], what)
            _wait(lambda: len(ray.get(worker.unfinished_ids.remote())) == 2,
                  f"{what}: the streams never reached the worker")
            ray.get(worker.step_engine.remote())  # their first tokens
            _wait(lambda s=streams: all(s.tokens), f"{what}: the first tokens never came")
            old = _ingress_replicas()
            started = time.monotonic()
            with ThreadPoolExecutor(1) as ex:
                stopped = ex.submit(stop)  # Serve's graceful shutdown waits for the streams
                _wait(lambda o=old: _stopping(o), f"{what}: the ingress replica never stopped")
                for _ in range(short - 1):  # the short stream to its end, the long one held
                    ray.get(worker.step_engine.remote())
                assert stopped.result(timeout=600) is not False, what
            streams.join()
        finally:
            ray.get(worker.resume_engine.remote())
        assert streams.tokens[0] == want[0] and streams.finish[0] == "length", what
        assert streams.ended[0] > started, what  # it ran during the shutdown and finished
        assert len(streams.errors) == 1 and streams.errors[0].startswith("1: UNAVAILABLE"), \
            (what, streams.errors)
        assert f"{grace} s grace period" in streams.errors[0], what
        assert len(streams.tokens[1]) == short, what  # the long one was cut where it was held
        assert streams.ended[1] - started >= grace, what  # not before the grace period ended
