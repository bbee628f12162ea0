"""The worker pool following the load, on real Ray with real gRPC and HTTP clients.

Each test deploys an app of its own (its own router, beside the session's shared app, on the
same Serve proxies) with a small KV pool, and builds the load it needs by holding engines
(`pause_engine`, `step_engine`) rather than racing them:

- a burst that parks streams on the one worker scales the pool up while it runs (the
  parked streams' KV counted as demand), the streams move to the new worker and finish with
  the greedy tokens of a quiet run, and the idle pool goes back down (the new worker
  drained and stopped); the pool never exceeds its maximum;
- raised bounds start workers at once; lowered ones drain the least-loaded worker, its
  running stream moved live to the other, one drain at a time; bad bounds are refused;
- a load that comes and goes faster than the upscale delay leaves the pool as it is, and
  the same load held past the delay scales it;
- an idle pool with `min_workers` 0 scales to zero; a request then waits while a worker
  starts, and is answered (the start's load time reported); with the start held (no CPU
  free: the new worker waits for resources) requests past the queue's timeout, or beyond
  its size, get 503 with Retry-After and gRPC UNAVAILABLE naming the retry time.

The heavy tier: each test loads the model into new workers several times.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import ray
import requests
from serve_fixtures import API_KEY

from kvserve.deploy.app import build_app
from kvserve.deploy.config import ServeConfig
from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc
from kvserve.router.lifecycle import kill_router
from kvserve.router.router import NAMESPACE
from kvserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

APP = "kvserve-autoscale"
# 32 blocks of 16 tokens per worker: 8 streams of ~90 tokens do not fit one
ENGINE = {"num_threads": 1, "kv_cache_tokens": 512, "max_model_len": 256, "max_num_seqs": 16,
          "host_cache_gib": 0.25}
CPUS = 0.5  # per worker
WAIT_S = 300.0  # bound on every wait for an observed event (a loaded machine is slow)


def _prompt(i: int) -> str:
    return f"Tale {i}: long ago, on an island far to the north, a fisher named Odd{i} saw"


def _reference(smol_llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in smol_llm.generate(prompts, p)]


def _until(what: str, check: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.1)
    return got


@dataclass
class App:
    router: Any
    grpc_target: str
    http_url: str  # the app's prefix included
    sizes: list[int] = field(default_factory=list)  # the pool's size, sampled

    @property
    def md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {API_KEY}"), ("application", APP))

    def info(self) -> dict[str, Any]:
        return ray.get(self.router.server_info.remote())

    def scaling(self) -> dict[str, Any]:
        return self.info()["autoscaling"]

    def workers(self) -> list[Any]:
        return ray.get(self.router.workers.remote())

    def serving(self) -> list[str]:
        return [w["worker_id"] for w in self.info()["workers"]
                if w["alive"] and w["state"] == "ready"]

    def stub(self) -> Any:
        return kvserve_pb2_grpc.KVServeStub(grpc.insecure_channel(self.grpc_target))


@contextlib.contextmanager
def autoscaled(serve_app, name: str, **autoscaling: Any) -> Iterator[App]:
    """An app of its own whose pool follows the load; its pool's size (serving, starting
    and draining workers) sampled all along."""
    from ray import serve

    router_name = f"kvserve-router-{name}"
    cfg = ServeConfig(num_cpus_per_worker=CPUS, engine=ENGINE, api_keys=[API_KEY],
                      grpc_port=serve_app.grpc_port, http_port=serve_app.http_port,
                      router_name=router_name, load_poll_interval_s=0.5,
                      migration_park_threshold_s=0.0, autoscaling=autoscaling)
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    app = App(ray.get_actor(router_name, namespace=NAMESPACE), serve_app.grpc_target,
              f"{serve_app.http_url}/{APP}")
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                a = app.scaling()
                app.sizes.append(a["serving_workers"] + a["starting_workers"]
                                 + a["draining_workers"])
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield app
    finally:
        stop.set()
        sampler.join(10)
        if APP in serve.status().applications:
            serve.delete(APP)
        kill_router(router_name)


class Streams:
    """Greedy gRPC streams to the app, each in a thread: tokens, last worker, errors."""

    def __init__(self, app: App, prompts: list[str], max_tokens: int, tag: str) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.workers = [""] * len(prompts)
        self.errors: list[str] = []
        self._ch = grpc.insecure_channel(app.grpc_target)
        stub = kvserve_pb2_grpc.KVServeStub(self._ch)

        def run(i: int) -> None:
            sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            try:
                for c in stub.GenerateStream(pb.GenerateRequest(
                        prompt=prompts[i], sampling=sampling, request_id=f"{tag}-{i}"),
                        metadata=app.md, timeout=900):
                    self.tokens[i].extend(c.delta_token_ids)
                    self.workers[i] = c.worker_id
            except grpc.RpcError as e:
                self.errors.append(f"{i}: {e.code().name} {e.details()}")

        self.threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join(900)
        self._ch.close()


def _arrived(worker: Any, n: int) -> bool:
    return len(ray.get(worker.unfinished_ids.remote())) >= n


def test_a_burst_scales_the_pool_up_while_it_runs_and_back_down_when_idle(serve_app, smol_llm):
    n, max_tokens = 8, 64
    prompts = [_prompt(i) for i in range(n)]
    want = _reference(smol_llm, prompts, max_tokens)
    # KV use 1.0 starts a worker: the device full, or parked streams' KV counted beyond it
    with autoscaled(serve_app, "burst", min_workers=1, max_workers=2, upscale_delay_s=1,
                    downscale_delay_s=3, upscale_kv_use=1.0, upscale_waiting=100) as app:
        assert app.serving() == ["worker-0"]
        w0 = app.workers()[0]
        ray.get(w0.pause_engine.remote())
        try:
            streams = Streams(app, prompts, max_tokens, "burst")
            _until("the burst reaching worker-0", lambda: _arrived(w0, n))
            # stepped by hand until its KV is full and streams park in its host tier; held
            # so, the pressure lasts until the policy acts
            for _ in range(200):
                if ray.get(w0.step_engine.remote())["parked"] > 0:
                    break
            else:
                raise AssertionError("worker-0 never parked a stream")
            _until("a second worker serving", lambda: "worker-1" in app.serving())
            a = app.scaling()
            assert a["decisions"].get("up:kv_pressure") == 1, a
            (cold,) = a["cold_starts"]
            assert cold["worker_id"] == "worker-1" and cold["reason"] == "kv_pressure"
            assert cold["cold_start_s"] >= cold["load_s"] > 0
            assert cold["pressure_to_serving_s"] >= cold["cold_start_s"]
            # the planner moves worker-0's parked (and running) streams to the new worker
            _until("streams moving to worker-1", lambda: app.info()["workers"][1]["stats"][
                "migration_streams_in"] >= 1)
        finally:
            ray.get(w0.resume_engine.remote())
        streams.join()
        assert not streams.errors, streams.errors
        assert streams.tokens == want  # every request answered, as a quiet run answers it
        # idle: back to one worker, the newer one drained and stopped
        _until("the pool back down to one worker", lambda: app.info()["workers"][1]["state"]
               == "drained")
        a = app.scaling()
        assert a["serving_workers"] == 1 and a["starting_workers"] == a["draining_workers"] == 0
        assert a["decisions"].get("down:idle", 0) + a["decisions"].get("down:low_load", 0) == 1
        assert app.serving() == ["worker-0"]
        assert max(app.sizes) == 2 and min(app.sizes) >= 1, sorted(set(app.sizes))


def test_bounds_start_workers_at_once_and_a_lowered_maximum_drains_live(serve_app, smol_llm):
    max_tokens = 48
    prompts = [_prompt(20), _prompt(21)]
    want = _reference(smol_llm, prompts, max_tokens)
    with autoscaled(serve_app, "bounds", min_workers=1, max_workers=3, upscale_delay_s=600,
                    downscale_delay_s=600) as app:
        with pytest.raises(ValueError, match=r"min_workers \(3\) must not exceed max_workers "
                                             r"\(2\)"):
            ray.get(app.router.set_autoscaling.remote(min_workers=3, max_workers=2))
        ray.get(app.router.set_autoscaling.remote(min_workers=2))  # no delay for a bound
        _until("a second worker for the raised minimum",
               lambda: app.serving() == ["worker-0", "worker-1"])
        assert app.scaling()["decisions"] == {"up:below_min": 1}
        handles = app.workers()
        for w in handles:
            ray.get(w.pause_engine.remote())
        try:
            streams = Streams(app, prompts, max_tokens, "bounds")
            # one stream on each worker (the second pick goes to the one without a request)
            _until("a stream on each worker", lambda: all(_arrived(w, 1) for w in handles))
            for w in handles:
                ray.get(w.step_engine.remote())  # their first tokens: they run
            _until("the first tokens", lambda: all(streams.tokens))
            # both workers serve one stream: the least loaded one is drained, its stream moved
            # live to the other while both engines are held
            ray.get(app.router.set_autoscaling.remote(min_workers=1, max_workers=1))
            drained = _until("a worker drained", lambda: [
                i for i, w in enumerate(app.info()["workers"]) if w["state"] == "drained"])
        finally:
            for w in handles:
                with contextlib.suppress(ray.exceptions.RayActorError):
                    ray.get(w.resume_engine.remote())
        streams.join()
        assert drained in ([0], [1]), drained
        kept = 1 - drained[0]
        assert not streams.errors, streams.errors
        assert streams.tokens == want
        assert streams.workers == [f"worker-{kept}"] * 2
        info = app.info()
        assert info["workers"][kept]["stats"]["migration_streams_in"] == 1
        assert info["autoscaling"]["decisions"] == {"up:below_min": 1, "down:above_max": 1}
        assert max(app.sizes) == 2, sorted(set(app.sizes))


def test_a_flapping_load_does_not_flap_the_pool(serve_app):
    with autoscaled(serve_app, "flap", min_workers=1, max_workers=2, upscale_delay_s=10,
                    downscale_delay_s=600, upscale_waiting=3) as app:
        w0 = app.workers()[0]
        stub = app.stub()
        sampling = pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

        def burst(k: int) -> list[threading.Thread]:
            ts = [threading.Thread(target=stub.Generate, args=(pb.GenerateRequest(
                prompt=_prompt(100 + i), sampling=sampling, request_id=f"flap-{k}-{i}"),),
                kwargs={"metadata": app.md, "timeout": 600}) for i in range(3)]
            for t in ts:
                t.start()
            return ts

        def pending() -> str:
            return (app.scaling()["pending"] or {}).get("direction", "")

        for k in range(4):  # requests wait for a second or two, then are served at once
            ray.get(w0.pause_engine.remote())
            ts = burst(k)
            _until("the policy wanting a worker", lambda: pending() == "up")
            time.sleep(1.0)
            ray.get(w0.resume_engine.remote())
            for t in ts:
                t.join(600)
            _until("the policy calm again", lambda: pending() == "")
        a = app.scaling()
        assert a["decisions"] == {} and app.serving() == ["worker-0"], a
        assert len(app.info()["workers"]) == 1 and max(app.sizes) == 1
        # the same load held past the delay scales the pool
        ray.get(w0.pause_engine.remote())
        try:
            ts = burst(9)
            _until("a second worker", lambda: "worker-1" in app.serving())
        finally:
            ray.get(w0.resume_engine.remote())
        for t in ts:
            t.join(600)
        d = app.scaling()["last_decisions"][-1]
        assert (d["direction"], d["reason"]) == ("up", "queue") and d["pressure_s"] >= 10


@ray.remote
class Ballast:
    def ping(self) -> bool:
        return True


def _dead(actor: Any) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=60)
    except ray.exceptions.ActorUnavailableError:  # (being killed)
        return False
    except ray.exceptions.RayActorError:
        return True
    return False


def _take_free_cpus() -> list[Any]:
    """Ballast actors holding every CPU of the session's Ray that is free, until none has
    been for a second (a drained worker's CPU comes back a little after its drain).

    Ray's view of free resources lags what actors hold: a ballast sized from a stale view
    may not fit, so one not placed within seconds is killed and the view read again; on any
    failure the ballast made so far is killed (it would starve the tests after this one)."""
    ballast: list[Any] = []
    try:
        quiet_since = time.monotonic()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() - quiet_since < 1.0:
            assert time.monotonic() < deadline, "the free CPUs could not be taken"
            free = ray.available_resources().get("CPU", 0.0)
            if free >= 0.01:  # (a worker takes 0.5)
                b = Ballast.options(num_cpus=free).remote()
                try:
                    ray.get(b.ping.remote(), timeout=30)
                except ray.exceptions.GetTimeoutError:  # the view was stale: it did not fit
                    ray.kill(b)
                else:
                    ballast.append(b)
                    # the next read must see this one's CPUs taken (bounded: more may free)
                    until = time.monotonic() + 10
                    while (ray.available_resources().get("CPU", 0.0) > free - 0.005
                           and time.monotonic() < until):
                        time.sleep(0.05)
                quiet_since = time.monotonic()
            time.sleep(0.1)
    except BaseException:
        for b in ballast:
            ray.kill(b)
        raise
    return ballast


def _http(app: App, max_tokens: int, timeout: float = 600) -> requests.Response:
    return requests.post(f"{app.http_url}/v1/completions", timeout=timeout,
                         headers={"authorization": f"Bearer {API_KEY}"},
                         json={"model": "default", "prompt": _prompt(50), "max_tokens": max_tokens,
                               "temperature": 0, "ignore_eos": True})


def test_scale_to_zero_and_back(serve_app, smol_llm):
    want = _reference(smol_llm, [_prompt(50)], 8)[0]
    with autoscaled(serve_app, "zero", min_workers=0, max_workers=1, upscale_delay_s=600,
                    downscale_delay_s=1) as app:
        _until("the pool at zero", lambda: app.info()["workers"][0]["state"] == "drained")
        a = app.scaling()
        assert a["serving_workers"] == a["starting_workers"] == 0 and a["desired_workers"] == 0
        health = requests.get(f"{app.http_url}/health", timeout=60)
        assert health.status_code == 200 and health.json()["status"] == "scaled_to_zero"
        # a request with no worker: one starts at once (no upscale delay from zero) and
        # serves it
        stub = app.stub()
        r = stub.Generate(pb.GenerateRequest(prompt=_prompt(50), sampling=pb.SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True)), metadata=app.md, timeout=600)
        assert list(r.token_ids) == want and r.worker_id == "worker-1"
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=app.md)
        a = info.autoscaling
        assert a.enabled and (a.min_workers, a.max_workers) == (0, 1)
        assert a.decisions["up:no_worker"] == 1 and a.decisions["down:idle"] >= 1
        (cold,) = a.cold_starts
        assert cold.worker_id == "worker-1" and cold.reason == "no_worker"
        assert cold.cold_start_s >= cold.load_seconds > 0
        # back to zero; then no CPU free: the next worker waits for resources, and requests
        # get a retry time once they waited queue_timeout_s, or at once beyond the queue
        ray.get(app.router.set_autoscaling.remote(queue_timeout_s=3, max_queued_requests=1))
        _until("the pool at zero again", lambda: app.info()["workers"][1]["state"] == "drained")
        stopped = app.workers()[1]
        _until("worker-1's actor gone (its CPU back)", lambda: _dead(stopped))
        ballast = _take_free_cpus()
        try:
            with pytest.raises(grpc.RpcError) as e:  # (a worker starts for it: worker-2)
                stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(
                    max_tokens=2)), metadata=app.md, timeout=600)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no worker is serving yet: no worker became ready within 3 s " \
                   "(queue_timeout_s); worker-2 is" in e.value.details(), e.value.details()
            # (Serve's gRPC proxy sends no trailing metadata with an error: the details say)
            assert re.search(r"; retry in about [1-9][0-9]* s$", e.value.details())
            waiting = "waiting for resources: {CPU: 0.5}"
            _until("worker-2 waiting for resources", lambda: (
                lambda w: (w["state"], w["alive"]) == (waiting, False))(app.info()["workers"][2]))
            assert app.scaling()["starting_workers"] == 1
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(1) as ex:
                first = ex.submit(_http, app, 4)
                _until("the request queued", lambda: app.scaling()["queued_requests"] == 1)
                beyond = _http(app, 4)  # the queue (of one) is full: refused at once
                waited = first.result(timeout=600)
            assert beyond.status_code == 503, beyond.text
            assert "1 requests already wait for a worker to start (max_queued_requests)" in \
                beyond.json()["error"]["message"], beyond.text
            assert waited.status_code == 503, waited.text
            msg = waited.json()["error"]["message"]
            assert f"within 3 s (queue_timeout_s); worker-2 is {waiting}; retry in about" in msg
            for r in (beyond, waited):
                assert int(r.headers["Retry-After"]) >= 1, r.headers
        finally:
            for b in ballast:
                ray.kill(b)
        # the CPU back: the waiting worker is placed, loads and serves
        _until("worker-2 serving", lambda: "worker-2" in app.serving())
        r = stub.Generate(pb.GenerateRequest(prompt=_prompt(50), sampling=pb.SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True)), metadata=app.md, timeout=600)
        assert list(r.token_ids) == want and r.worker_id == "worker-2"
