"""Faults: a client cancel frees the KV on the worker; a killed worker is survived and replaced."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import ray

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc


def _long(session: str | None = None, n: int = 800) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt="Count from one to one thousand:",
                             sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True))
    if session:
        req.session_id = session
    return req


def _wait_idle(worker, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = ray.get(worker.stats.remote())
        if s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"worker still busy after the cancel: {s}")
        time.sleep(0.1)


def _wait_router_idle(serve_app, timeout: float = 30.0) -> None:
    """Until the router has counted every earlier request out (its release calls are
    fire-and-forget, and may land just after the workers went idle)."""
    deadline = time.monotonic() + timeout
    while any(w["inflight"] for w in serve_app.server_info()["workers"]):
        if time.monotonic() > deadline:
            raise AssertionError(f"router still counts requests: {serve_app.server_info()}")
        time.sleep(0.1)


def _worker(serve_app, worker_id: str):
    return serve_app.workers()[int(worker_id.rsplit("-", 1)[1])]


def test_grpc_cancel_mid_stream_frees_kv(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        for _attempt in range(3):
            call = stub.GenerateStream(_long(), metadata=serve_app.metadata)
            first = [next(call) for _ in range(3)]
            worker = _worker(serve_app, first[0].worker_id)
            busy = ray.get(worker.stats.remote())
            assert busy["kv_blocks_used"] > 0, busy
            call.cancel()
            if not serve_app.cancels_serve_dropped():
                _wait_idle(worker)
                return
            _wait_idle(worker, timeout=300)  # Serve never passed the cancel on: let it end
    raise AssertionError("Serve's proxy dropped the cancel three times in a row")


@pytest.mark.parametrize("n", [1, 2], ids=["one choice", "two choices"])
def test_http_disconnect_mid_stream_frees_kv(serve_app, n):
    body = json.dumps({"prompt": "Count from one to one thousand:", "max_tokens": 800,
                       "ignore_eos": True, "stream": True, "n": n}).encode()
    req = urllib.request.Request(serve_app.http_url + "/v1/completions", data=body, headers={
        "content-type": "application/json", "authorization": f"Bearer {serve_app.api_key}"})
    resp = urllib.request.urlopen(req, timeout=60)
    line = b""
    while not line.startswith(b"data: {"):
        line = resp.readline()
    worker = _worker(serve_app, json.loads(line[6:])["kvserve_worker"])
    resp.close()  # the client goes away mid-stream
    for w in (serve_app.workers() if n > 1 else [worker]):  # choices may sit on either worker
        _wait_idle(w)


def test_killed_worker_is_survived_and_replaced(serve_app):
    serve_app.wait_all_alive()
    _wait_router_idle(serve_app, 300)  # an earlier stream still counted would skew the spread
    md = serve_app.metadata
    restarts_before = {w["worker_id"]: w["restarts"] for w in serve_app.server_info()["workers"]}
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        # two long streams, one per worker (sessions pin nothing yet: least loaded alternates)
        calls = [stub.GenerateStream(_long(n=600), metadata=md) for _ in range(2)]
        firsts = [next(c) for c in calls]
        by_worker = {f.worker_id: c for f, c in zip(firsts, calls, strict=True)}
        assert set(by_worker) == {"worker-0", "worker-1"}
        victim_id = "worker-0"
        victim = _worker(serve_app, victim_id)
        ray.get(victim.pause_engine.remote())  # its stream cannot end before the kill
        ray.kill(victim, no_restart=False)

        # requests arriving now are served (by the survivor, or retried before a first token)
        def short(i: int) -> pb.GenerateResponse:
            return stub.Generate(pb.GenerateRequest(
                prompt=f"Say {i}.", sampling=pb.SamplingParams(max_tokens=3)),
                metadata=md, timeout=120)

        with ThreadPoolExecutor(6) as ex:
            served = list(ex.map(short, range(6)))
        assert all(r.usage.completion_tokens >= 1 for r in served)

        # the stream that was on the dead worker ends with UNAVAILABLE, tokens accounted for
        with pytest.raises(grpc.RpcError) as ei:
            for _ in by_worker[victim_id]:
                pass
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "mid-stream" in ei.value.details() and "tokens" in ei.value.details()
        by_worker["worker-1"].cancel()

    # the worker comes back (a fresh actor) and the router notices
    serve_app.wait_all_alive(timeout=120)
    if serve_app.cancels_serve_dropped():  # the survivor's stream runs on: let it end
        _wait_idle(_worker(serve_app, "worker-1"), timeout=300)
    info = {w["worker_id"]: w for w in serve_app.server_info()["workers"]}
    assert info[victim_id]["restarts"] == restarts_before[victim_id] + 1
    # restarted by Ray, it is the same named actor (the Ray dashboard's, `ray.get_actor`'s)
    named = ray.get_actor("kvserve-worker-0", namespace="kvserve")
    assert named._actor_id == victim._actor_id
    assert ray.get(named.info.remote())["worker_id"] == victim_id
    assert ray.get(_worker(serve_app, victim_id).stats.remote())["running"] == 0

    stop = threading.Event()
    seen: set[str] = set()
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)

        def go(i: int) -> None:
            if not stop.is_set():
                seen.add(stub.Generate(pb.GenerateRequest(
                    prompt=f"Name {i} animals.", sampling=pb.SamplingParams(max_tokens=4)),
                    metadata=md, timeout=120).worker_id)

        with ThreadPoolExecutor(4) as ex:
            list(ex.map(go, range(8)))
    assert victim_id in seen


def test_overload_is_shed_with_resource_exhausted(serve_app):
    _wait_router_idle(serve_app)
    router = serve_app.router
    old = ray.get(router.set_max_inflight_per_worker.remote(1))
    try:
        with grpc.insecure_channel(serve_app.grpc_target) as ch:
            stub = kvserve_pb2_grpc.KVServeStub(ch)
            calls = [stub.GenerateStream(_long(n=400), metadata=serve_app.metadata)
                     for _ in range(2)]
            assert {next(c).worker_id for c in calls} == {"worker-0", "worker-1"}
            with serve_app.held():  # the two streams cannot end while the others are shed
                with pytest.raises(grpc.RpcError) as ei:
                    stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=serve_app.metadata)
                assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "retry later" in ei.value.details()
                body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
                req = urllib.request.Request(
                    serve_app.http_url + "/v1/completions", data=body,
                    headers={"content-type": "application/json",
                             "authorization": f"Bearer {serve_app.api_key}"})
                with pytest.raises(urllib.error.HTTPError) as he:
                    urllib.request.urlopen(req, timeout=60)
                assert he.value.code == 429
                for c in calls:
                    c.cancel()
    finally:
        ray.get(router.set_max_inflight_per_worker.remote(old))
    dropped = serve_app.cancels_serve_dropped()  # then that stream runs to its end
    for w in serve_app.workers():
        _wait_idle(w, timeout=300 if dropped else 30)


def test_workers_export_engine_stats_as_metrics(serve_app):
    for w in serve_app.workers():
        names = ray.get(w.exported_metrics.remote())
        stats = ray.get(w.stats.remote())
        numeric = [k for k, v in stats.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)]
        assert len(names) == len(numeric) and "kvserve_worker_kv_blocks_free" in names


class _Calls:
    """A router handle that keeps the ref of every call made through it, so that a test can
    wait for a call it did not make itself (a fire-and-forget release) to have run."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.refs: dict[str, list[Any]] = {}

    def __getattr__(self, name: str) -> Any:
        method, refs = getattr(self.router, name), self.refs.setdefault(name, [])

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                refs.append(ref := method.remote(*args, **kwargs))
                return ref

        return _Method


def test_a_pick_cancelled_midway_gives_its_slot_back(serve_app):
    """A request cancelled while the router decides (client gone, a sibling choice of `n`
    failed) must not leave the router counting it: the count would shed load for good."""
    import asyncio

    from kvserve.deploy.service import GenRequest, Service
    from kvserve.sampling import SamplingParams

    _wait_router_idle(serve_app)
    calls = _Calls(serve_app.router)
    svc = Service(serve_app.config, router=calls)  # an ingress's view of it

    async def go() -> None:
        req = GenRequest("req-cancelled-pick", [1, 2, 3], SamplingParams())
        t = asyncio.ensure_future(svc._pick([], req, [], None))
        while not calls.refs.get("pick"):  # the pick is on its way to the router...
            await asyncio.sleep(0)
        t.cancel()  # ...and its caller is cancelled before the answer
        with pytest.raises(asyncio.CancelledError):
            await t
        pick = await calls.refs["pick"][0]
        assert "idx" in pick, pick  # the router counted a slot for the cancelled request
        deadline = time.monotonic() + 60
        while not calls.refs.get("release"):  # the service gives it back once it has the answer
            assert time.monotonic() < deadline, "the cancelled pick's slot was never released"
            await asyncio.sleep(0.01)
        assert await calls.refs["release"][0] is True  # the slot it gave back was counted
        assert not any(w["inflight"] for w in (await calls.router.server_info.remote())["workers"])

    asyncio.run(go())
