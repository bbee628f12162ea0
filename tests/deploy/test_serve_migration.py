"""A stream moved mid-generation (router.move_stream) over gRPC streaming and HTTP SSE: the
client's one stream goes on from the other worker, no token repeated or lost, and the
response names the worker that finished it."""

from __future__ import annotations

import json
import queue
import threading
import time

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
    # GetServerInfo shows the move in the target's stats
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md)
    w = {x.worker_id: x for x in info.workers}[target]
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
