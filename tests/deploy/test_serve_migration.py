"""A stream moved mid-generation (router.move_stream) over gRPC streaming and HTTP SSE: the
client's one stream goes on from the other worker, no token repeated or lost, and the
response names the worker that finished it."""

from __future__ import annotations

import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
import requests

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

PROMPT = "Write a long story about a lighthouse keeper and the sea."
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def stub(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        yield kvserve_pb2_grpc.KVServeStub(ch)


def _greedy() -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _move(serve_app, rid: str, worker_id: str) -> str:
    src = int(worker_id.rsplit("-", 1)[1])
    res = ray.get(serve_app.router.move_stream.remote(rid, src, 1 - src))
    assert "error" not in res, res
    assert res["bytes"] > 0
    return f"worker-{1 - src}"


def test_grpc_stream_moved_mid_generation(serve_app, stub):
    md = serve_app.metadata
    ref = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_greedy()), metadata=md)
    before = serve_app.server_info()["workers"]
    with serve_app.held() as workers:  # the stream cannot end before it is moved
        stream = stub.GenerateStream(
            pb.GenerateRequest(prompt=PROMPT, sampling=_greedy(), request_id="moved-grpc"),
            metadata=md)
        idx, _ = serve_app.worker_of(workers, "moved-grpc")
        ray.get(workers[idx].step_engine.remote())  # its first token
        first = next(stream)
        assert not first.finish_reason and first.worker_id == f"worker-{idx}"
        target = _move(serve_app, "moved-grpc", first.worker_id)
    chunks = [first, *stream]
    assert "".join(c.delta_text for c in chunks) == ref.text
    assert [t for c in chunks for t in c.delta_token_ids] == list(ref.token_ids)
    last = chunks[-1]
    assert last.finish_reason == "length" and last.worker_id == target
    assert last.usage.prompt_tokens == ref.usage.prompt_tokens
    assert last.usage.completion_tokens == MAX_TOKENS
    after = serve_app.server_info()["workers"]
    moved_in = [a["stats"]["migration_streams_in"] - b["stats"]["migration_streams_in"]
                for a, b in zip(after, before, strict=True)]
    assert moved_in[int(target[-1])] == 1
    # the moved request's router slot moved with it and was given back (the ingress gives it
    # back just after the last chunk: wait for that)
    deadline = time.monotonic() + 10
    while any(w["inflight"] for w in after) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = serve_app.server_info()["workers"]
    assert all(w["inflight"] == 0 for w in after)
    # GetServerInfo shows the move in the target's stats: the router's own counters at once,
    # the engine's from the worker's next load poll (once a second), which may not have come yet
    deadline = time.monotonic() + 10
    while True:
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md)
        w = {x.worker_id: x for x in info.workers}[target]
        if w.stats["migration_moved_in"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert w.stats["migration_streams_in"] >= 1 and w.stats["migration_bytes_in"] > 0
    assert w.stats["migration_moved_in"] >= 1 and w.stats["draining"] == 0


def test_http_sse_moved_mid_generation(serve_app):
    url = f"{serve_app.http_url}/v1/completions"
    headers = {"authorization": f"Bearer {serve_app.api_key}"}
    body = {"model": "default", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    ref = requests.post(url, json=body, headers=headers, timeout=300).json()
    q: queue.Queue = queue.Queue()  # the client's events, read in a thread

    def client() -> None:
        try:
            r = requests.post(url, json={**body, "stream": True,
                                         "stream_options": {"include_usage": True}},
                              headers=headers, stream=True, timeout=300)
            assert r.status_code == 200, r.text
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    q.put(json.loads(line[6:]))
        except BaseException as e:
            q.put(e)
        q.put(None)

    thread = threading.Thread(target=client)
    with serve_app.held() as workers:  # the stream cannot end before it is moved
        known = serve_app.unfinished()
        thread.start()
        idx, rid = serve_app.worker_of(workers, known=known)
        ray.get(workers[idx].step_engine.remote())  # its first token
        first = q.get(timeout=300)
        assert isinstance(first, dict) and first["id"] == f"cmpl-{rid}", first
        target = _move(serve_app, rid, first["kvserve_worker"])
    thread.join(300)
    events = [first, *iter(q.get_nowait, None)]
    assert not any(isinstance(e, BaseException) or "error" in e for e in events), events
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == ref["choices"][0]["text"]
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals and finals[-1]["kvserve_worker"] == target
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert events[-1]["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]


def test_drain_admin_rejects_bad_input_and_callers_without_a_key(serve_app, stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.DrainWorker(pb.DrainWorkerRequest(worker_id="worker-9"), metadata=serve_app.metadata)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker-9" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.DrainWorker(pb.DrainWorkerRequest(worker_id="worker-0"))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    url = f"{serve_app.http_url}/v1/admin/drain"
    headers = {"authorization": f"Bearer {serve_app.api_key}"}
    assert requests.post(url, json={"worker": 0}, timeout=60).status_code == 401
    bad = requests.post(url, json={"worker": "nope"}, headers=headers, timeout=60)
    assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"]
    neg = requests.post(url, json={"worker": 1, "timeout_s": -1}, headers=headers, timeout=60)
    assert neg.status_code == 400
    assert all(w["alive"] and not w["stats"]["draining"] for w in serve_app.server_info()["workers"])


def _stream_held(serve_app, stub, workers, rid: str):
    """A greedy gRPC stream `rid` on a held worker, its first chunk read: (stream, first,
    worker index)."""
    stream = stub.GenerateStream(
        pb.GenerateRequest(prompt=PROMPT, sampling=_greedy(), request_id=rid),
        metadata=serve_app.metadata)
    idx, _ = serve_app.worker_of(workers, rid)
    ray.get(workers[idx].step_engine.remote())  # its first token: it runs now
    first = next(stream)
    assert not first.finish_reason and first.worker_id == f"worker-{idx}"
    return stream, first, idx


def test_move_stream_rpc_moves_a_running_stream_live(serve_app, stub):
    """gRPC MoveStream (empty worker_id: the router picks): the running stream's KV is
    copied live, the answer says from where to where with its stall and bytes, and the
    client's stream goes on there with the unmoved tokens; GetServerInfo listed it."""
    md = serve_app.metadata
    ref = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_greedy()), metadata=md)
    with serve_app.held() as workers:
        stream, first, idx = _stream_held(serve_app, stub, workers, "op-live")
        deadline = time.monotonic() + 30
        while True:  # the router's next poll lists it, running, with its blocks
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md)
            mine = [s for w in info.workers for s in w.streams if s.request_id == "op-live"]
            if (mine and mine[0].state == "running") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert mine and mine[0].state == "running" and mine[0].kv_blocks > 0, mine
        assert mine[0].tokens > ref.usage.prompt_tokens
        res = stub.MoveStream(pb.MoveStreamRequest(request_id="op-live"), metadata=md)
    assert (res.request_id, res.from_worker, res.to_worker) == (
        "op-live", f"worker-{idx}", f"worker-{1 - idx}")
    assert res.method == "live" and res.stall_ms > 0 and res.bytes > 0 and res.rounds >= 2
    chunks = [first, *stream]
    assert [t for c in chunks for t in c.delta_token_ids] == list(ref.token_ids)
    assert "".join(c.delta_text for c in chunks) == ref.text
    assert chunks[-1].worker_id == res.to_worker and chunks[-1].finish_reason == "length"


def test_admin_move_over_http_by_snapshot_and_its_errors(serve_app, stub):
    """POST /v1/admin/move with stop_and_copy; unknown request 404, unknown worker 400,
    no room on the target 409 with the stream untouched; gRPC gives the same codes."""
    md = serve_app.metadata
    url = f"{serve_app.http_url}/v1/admin/move"
    headers = {"authorization": f"Bearer {serve_app.api_key}"}
    ref = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_greedy()), metadata=md)
    assert requests.post(url, json={"request_id": "x"}, timeout=60).status_code == 401
    nope = requests.post(url, json={"request_id": "no-such"}, headers=headers, timeout=60)
    assert nope.status_code == 404 and "no-such" in nope.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        stub.MoveStream(pb.MoveStreamRequest(request_id="no-such"), metadata=md)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with serve_app.held() as workers:
        stream, first, idx = _stream_held(serve_app, stub, workers, "op-snap")
        bad = requests.post(url, json={"request_id": "op-snap", "worker_id": "worker-7"},
                            headers=headers, timeout=60)
        assert bad.status_code == 400 and "worker-7" in bad.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as e:
            stub.MoveStream(pb.MoveStreamRequest(request_id="op-snap", worker_id="worker-7"),
                            metadata=md)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the target's pool all reserved (by moves that never come): no room there
        src, dst = workers[idx], workers[1 - idx]
        info = ray.get(src.live_begin.remote("op-snap", "probe"))
        assert ray.get(src.live_abandon.remote("op-snap")) is False  # nothing frozen
        hogs: list[str] = []
        for tokens in (900, 1):  # big reservations, then ones as large as the stream's
            while "error" not in ray.get(dst.live_reserve.remote(
                    {**info, "request_id": f"hog{len(hogs)}", "tokens": tokens}, 100)):
                hogs.append(f"hog{len(hogs)}")
        try:
            full = requests.post(url, json={"request_id": "op-snap"}, headers=headers, timeout=60)
            assert full.status_code == 409, full.text
            assert "no room" in full.json()["error"]["message"]
            with pytest.raises(grpc.RpcError) as e:
                stub.MoveStream(pb.MoveStreamRequest(request_id="op-snap",
                                                     worker_id=f"worker-{1 - idx}"), metadata=md)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            for h in hogs:
                ray.get(dst.live_cancel.remote(h))
        ok = requests.post(url, json={"request_id": "op-snap", "stop_and_copy": True},
                           headers=headers, timeout=120)
        assert ok.status_code == 200, ok.text
        res = ok.json()
        assert res["method"] == "snapshot" and res["to_worker"] == f"worker-{1 - idx}"
        assert res["from_worker"] == f"worker-{idx}" and res["bytes"] > 0
    chunks = [first, *stream]
    assert [t for c in chunks for t in c.delta_token_ids] == list(ref.token_ids)
    assert chunks[-1].worker_id == f"worker-{1 - idx}"


@pytest.mark.slow  # ~18 s; one live move stays in the default tier
def test_many_live_moves_at_once_in_both_directions(serve_app, stub):
    """Four streams, half on each worker, all moved to the other worker at once while the
    engines are held: every client reads the unmoved tokens from the worker it moved to, and
    afterwards no KV block, reservation or stream is left on either worker."""
    md = serve_app.metadata
    prompts = [f"{PROMPT} Part {i}." for i in range(4)]
    refs = [stub.Generate(pb.GenerateRequest(prompt=p, sampling=_greedy()), metadata=md)
            for p in prompts]
    old = ray.get(serve_app.router.set_max_inflight_per_worker.remote(2))  # 2 per worker
    try:
        with serve_app.held() as workers:
            streams = [stub.GenerateStream(pb.GenerateRequest(
                prompt=p, sampling=_greedy(), request_id=f"many-{i}"), metadata=md)
                for i, p in enumerate(prompts)]
            where = {f"many-{i}": serve_app.worker_of(workers, f"many-{i}")[0] for i in range(4)}
            assert sorted(where.values()) == [0, 0, 1, 1], where
            for w in workers:
                ray.get(w.step_engine.remote())  # every stream runs
            firsts = [next(s) for s in streams]
            with ThreadPoolExecutor(4) as ex:
                answers = list(ex.map(lambda i: stub.MoveStream(pb.MoveStreamRequest(
                    request_id=f"many-{i}", worker_id=f"worker-{1 - where[f'many-{i}']}"),
                    metadata=md), range(4)))
        assert all(a.method == "live" for a in answers)
        for i, (s, first, ref) in enumerate(zip(streams, firsts, refs, strict=True)):
            chunks = [first, *s]
            assert [t for c in chunks for t in c.delta_token_ids] == list(ref.token_ids), i
            assert chunks[-1].worker_id == f"worker-{1 - where[f'many-{i}']}"
    finally:
        ray.get(serve_app.router.set_max_inflight_per_worker.remote(old))
    deadline = time.monotonic() + 60
    while True:  # nothing left behind on either worker
        loads = [ray.get(w.load.remote()) for w in serve_app.workers()]
        left = [(ld["stats"]["kv_blocks_used"], ld["stats"]["kv_blocks_reserved"], ld["streams"])
                for ld in loads]
        if all(x == (0, 0, 0) for x in left) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(x == (0, 0, 0) for x in left), left
