"""The batched token path end to end (real Ray, workers, gRPC): many concurrent streams keep
their order and come in shared batches; streams cancelled mid-batch take nothing from the
others; a request id sent again while it runs is refused without touching the first stream;
a slow consumer stalls nobody; a worker killed mid-batch fails exactly its own
streams with UNAVAILABLE, and its state goes through loading back to ready."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import ray

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc
from kvserve.sampling import SamplingParams


def _req(prompt: str, n: int, session: str | None = None) -> pb.GenerateRequest:
    r = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True))
    if session:
        r.session_id = session
    return r


def _ingress(serve_app) -> dict:
    req = urllib.request.Request(serve_app.http_url + "/v1/server_info",
                                 headers={"authorization": f"Bearer {serve_app.api_key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["ingress"]


def _wait_idle(serve_app, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = [ray.get(w.stats.remote()) for w in serve_app.workers()]
        info = serve_app.server_info()["workers"]
        if all(s["running"] == s["waiting"] == s["kv_blocks_used"] == 0 for s in stats) \
                and not any(w["inflight"] for w in info):
            return
        assert time.monotonic() < deadline, (stats, info)
        time.sleep(0.2)


def test_many_concurrent_streams_keep_their_order(serve_app, smol_llm):
    prompts = [f"Write a list of {i} fruits and {i + 3} colours:" for i in range(24)]
    want = [o.token_ids for o in smol_llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    before = _ingress(serve_app)

    def stream(i: int) -> list[pb.GenerateStreamResponse]:
        with grpc.insecure_channel(serve_app.grpc_target) as ch:
            stub = kvserve_pb2_grpc.KVServeStub(ch)
            return list(stub.GenerateStream(_req(prompts[i], 16), metadata=serve_app.metadata,
                                            timeout=300))

    with ThreadPoolExecutor(24) as ex, serve_app.held():
        # held until all 24 are on the workers: they then run side by side, whatever the
        # pace at which this machine sends them
        known = serve_app.unfinished()
        futs = [ex.submit(stream, i) for i in range(24)]
        deadline = time.monotonic() + 300
        while len(serve_app.unfinished() - known) < 24:
            assert time.monotonic() < deadline, "the streams never all reached a worker"
            time.sleep(0.05)
    got = [f.result() for f in futs]
    chunks = 0
    for i, chunks_i in enumerate(got):
        assert [t for c in chunks_i for t in c.delta_token_ids] == want[i], i
        assert chunks_i[-1].finish_reason == "length"
        chunks += len(chunks_i)
    after = _ingress(serve_app)
    assert after["token_streams"] <= 2  # one per worker, for all 24 streams
    # the workers' Ray items carried several streams' chunks each
    assert after["token_batches"] - before["token_batches"] < chunks / 2
    _wait_idle(serve_app)


def test_streams_cancelled_mid_batch_take_nothing_from_the_others(serve_app, smol_llm):
    keep = [f"Tell me about the river number {i}." for i in range(3)]
    want = [o.token_ids for o in smol_llm.generate(
        keep, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    # one session, interleaved, each request placed before the next is sent: the first cut
    # and the first kept stream always share the session's worker (load 1 <= max_imbalance 2),
    # so that worker's batches mix both kinds
    session = f"cancel-{time.monotonic()}"
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        md = serve_app.metadata
        cut, kept, cut_firsts, kept_firsts = [], [], [], []

        def start(prompt: str, n: int, rid: str) -> tuple[Any, pb.GenerateStreamResponse]:
            req = _req(prompt, n, session)
            req.request_id = rid
            call = stub.GenerateStream(req, metadata=md)
            idx, _ = serve_app.worker_of(workers, rid)
            ray.get(workers[idx].step_engine.remote())  # its first token
            return call, next(call)

        # held, stepped by hand: every kept stream is still running when the cuts leave
        with serve_app.held() as workers:
            for i, p in enumerate(keep):
                call, first = start(f"Count to {i}00:", 400, f"{session}-cut-{i}")
                cut.append(call)
                cut_firsts.append(first)
                call, first = start(p, 24, f"{session}-kept-{i}")
                kept.append(call)
                kept_firsts.append(first)
            assert cut_firsts[0].worker_id == kept_firsts[0].worker_id, cut_firsts + kept_firsts
            for c in cut:
                c.cancel()  # the client leaves while its chunks share batches with the others
        got = [list(first.delta_token_ids) + [t for r in c for t in r.delta_token_ids]
               for first, c in zip(kept_firsts, kept, strict=True)]
    assert got == want
    dropped = serve_app.cancels_serve_dropped()  # those streams run to their end
    _wait_idle(serve_app, timeout=300 if dropped else 60)  # the cancelled ones' KV freed


def test_a_request_id_sent_again_while_running_leaves_the_first_stream_whole(serve_app, smol_llm):
    prompt = "Write a short story about a lighthouse."
    want = smol_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48,
                                                      ignore_eos=True))[0].token_ids
    rid = f"reused-{time.monotonic()}"
    first_req, again = _req(prompt, 48, rid), _req("Hi.", 4, rid)  # one session: one worker
    first_req.request_id = again.request_id = rid
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        with serve_app.held() as workers:  # the first stream is still running when the second comes
            call = stub.GenerateStream(first_req, metadata=serve_app.metadata, timeout=120)
            idx, _ = serve_app.worker_of(workers, rid)
            ray.get(workers[idx].step_engine.remote())  # its first token
            head = next(call)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.GenerateStream(again, metadata=serve_app.metadata, timeout=120))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "in use" in e.value.details()
        rest = list(call)
    assert list(head.delta_token_ids) + [t for c in rest for t in c.delta_token_ids] == want
    assert rest[-1].finish_reason == "length" and rest[-1].usage.completion_tokens == 48
    _wait_idle(serve_app)


def test_a_slow_consumer_stalls_no_other_stream(serve_app):
    from kvserve.deploy.service import Service

    async def run() -> tuple[list[dict], list[dict], int]:
        svc = Service(serve_app.config, router=serve_app.router)
        await svc.start()
        ids = svc.tokenize(prompt="Describe the weather in a long paragraph.")
        params = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
        slow_req = svc.build(ids, params, session_id="slowpoke")
        fast_req = svc.build(ids, params, session_id="slowpoke")  # same worker, same batches
        slow: list[dict] = []
        fast: list[dict] = []

        reading = asyncio.Event()

        async def read_slow() -> None:
            async for c in svc.stream(slow_req):
                slow.append(c)
                await reading.wait()  # a client that stops reading after its first chunk

        async def read_fast() -> None:
            async for c in svc.stream(fast_req):
                fast.append(c)

        slow_task = asyncio.create_task(read_slow())
        await asyncio.wait_for(read_fast(), 180)  # a stalled path fails here, not hangs
        slow_then = len(slow)
        reading.set()
        await asyncio.wait_for(slow_task, 180)
        return slow, fast, slow_then

    slow, fast, slow_then = asyncio.run(run())
    tokens = [t for c in fast for t in c["token_ids"]]
    assert len(tokens) == 40 and [t for c in slow for t in c["token_ids"]] == tokens
    assert "".join(c["text"] for c in slow) == "".join(c["text"] for c in fast)
    # the fast stream ran to its end while the slow reader read nothing after its first
    # chunk (had the slow one stalled the shared path, the fast one would never end) ...
    assert slow_then <= 1, slow_then
    # ... whose chunks merged in the ingress rather than queueing one by one
    assert max(len(c["token_ids"]) for c in slow) > 1
    assert slow[-1]["finish_reason"] == "length" and slow[-1]["usage"][2] == 40
    _wait_idle(serve_app)


def test_worker_killed_mid_batch_fails_exactly_its_streams(serve_app):
    serve_app.wait_all_alive()
    md = serve_app.metadata
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        calls = [stub.GenerateStream(_req(f"Count from {i} to one thousand:", 150), metadata=md)
                 for i in range(6)]
        firsts = [next(c) for c in calls]
        on = {f.worker_id for f in firsts}
        assert on == {"worker-0", "worker-1"}, on  # the router spread them
        victim = "worker-0"
        w0 = serve_app.workers()[0]
        ray.get(w0.pause_engine.remote())  # its streams cannot end before the kill
        ray.kill(w0, no_restart=False)
        states: list[str] = []
        with ThreadPoolExecutor(1) as ex:
            watch = ex.submit(_watch_state, stub, md, victim, states)
            for first, call in zip(firsts, calls, strict=True):
                n = len(first.delta_token_ids)
                if first.worker_id == victim:
                    with pytest.raises(grpc.RpcError) as ei:
                        for r in call:
                            n += len(r.delta_token_ids)
                    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert f"after {n} tokens" in ei.value.details()
                else:
                    last = first
                    for r in call:
                        n, last = n + len(r.delta_token_ids), r
                    assert n == 150 and last.finish_reason == "length"
            watch.result(timeout=180)
    # the restarted worker reported its start-up (GetServerInfo) until it was ready
    assert "ready" == states[-1] and "loading" in states, states
    serve_app.wait_all_alive(timeout=120)
    _wait_idle(serve_app)


def _watch_state(stub, md, worker_id: str, states: list[str]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md, timeout=30)
        w = next(w for w in info.workers if w.worker_id == worker_id)
        if not states or states[-1] != w.state:
            states.append(w.state)
        if w.state == "ready" and len(states) > 1:
            assert w.load_seconds > 0
            return
        time.sleep(0.05)
