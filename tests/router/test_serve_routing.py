"""Routing: pure policy decisions, and session / prefix affinity and load spreading end to end."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc
from kvserve.router.policy import RouteRequest, WorkerView, make_policy


def _views(loads: list[int], held: dict[int, set[int]] | None = None) -> list[WorkerView]:
    held = held or {}
    return [WorkerView(i, f"w{i}", alive=True, inflight=n, kv_blocks_free=100,
                       held_device=held.get(i, set())) for i, n in enumerate(loads)]


def test_affinity_prefers_session_then_longest_prefix():
    pol = make_policy("affinity", max_imbalance=2)
    views = _views([1, 0, 0], held={0: {11, 12}, 2: {11, 12, 13}})
    d = pol.choose(views, RouteRequest([11, 12, 13, 14], session_worker=0))
    assert (d.idx, d.reason) == (0, "session")
    d = pol.choose(views, RouteRequest([11, 12, 13, 14]))
    assert (d.idx, d.reason, d.matched_blocks) == (2, "prefix", 3)
    d = pol.choose(views, RouteRequest([99]))
    assert d.reason == "least_loaded" and d.idx in (1, 2)


def test_affinity_gives_way_beyond_the_imbalance_bound():
    pol = make_policy("affinity", max_imbalance=2)
    views = _views([5, 2], held={0: {1, 2, 3}})
    d = pol.choose(views, RouteRequest([1, 2, 3], session_worker=0))
    assert (d.idx, d.reason) == (1, "least_loaded")
    views[0].inflight = 4  # within the bound again
    assert pol.choose(views, RouteRequest([1, 2, 3])).idx == 0


def test_affinity_prefers_workers_holding_the_adapter_within_the_bound():
    pol = make_policy("affinity", max_imbalance=2)
    views = _views([1, 0, 0])
    views[0].lora_device = {"sql"}
    views[2].lora_host = {"sql", "chat"}
    d = pol.choose(views, RouteRequest([7], lora="sql"))
    assert (d.idx, d.reason) == (0, "lora_device")  # in a device slot beats least loaded
    d = pol.choose(views, RouteRequest([7], lora="chat"))
    assert (d.idx, d.reason) == (2, "lora_host")  # then in host memory
    d = pol.choose(views, RouteRequest([7], lora="other"))
    assert d.reason == "least_loaded"
    # a prefix the adapter's requests computed (its own hash chain) comes first
    views[1].held_device = {7}
    assert pol.choose(views, RouteRequest([7], lora="sql")).reason == "prefix"
    views[1].held_device = set()
    # a hot adapter is not pinned to its worker: past the bound the request goes elsewhere
    views[0].inflight = 3
    d = pol.choose(views, RouteRequest([7], lora="sql"))
    assert (d.idx, d.reason) == (2, "lora_host")
    views[2].lora_host = {"chat"}
    d = pol.choose(views, RouteRequest([7], lora="sql"))
    assert d.idx in (1, 2) and d.reason == "least_loaded"
    views[2].lora_device = {"sql"}
    d = pol.choose(views, RouteRequest([7], lora="sql"))
    assert (d.idx, d.reason) == (2, "lora_device")  # another holder within the bound


def test_least_loaded_spreads_ties_and_unknown_policy():
    pol = make_policy("least_loaded", max_imbalance=0)
    views = _views([0, 0])
    picks = [pol.choose(views, RouteRequest([])).idx for _ in range(4)]
    assert sorted(picks) == [0, 0, 1, 1]
    views[1].inflight = 3
    assert pol.choose(views, RouteRequest([])).idx == 0
    # round robin rotates over the workers whatever their load
    rr = make_policy("round_robin", 0)
    picks = [rr.choose(views, RouteRequest([])).idx for _ in range(6)]
    assert picks in ([0, 1] * 3, [1, 0] * 3), picks
    three = _views([5, 0, 2])
    picks = [rr.choose(three, RouteRequest([])).idx for _ in range(6)]
    assert sorted(picks[:3]) == [0, 1, 2] and picks[3:] == picks[:3], picks
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", 0)


# ---- end to end ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stub(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        yield kvserve_pb2_grpc.KVServeStub(ch)


def _gen(stub, md, prompt: str, session: str | None = None, n: int = 4) -> pb.GenerateResponse:
    req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=n, temperature=0))
    if session:
        req.session_id = session
    return stub.Generate(req, metadata=md, timeout=120)


def test_session_sticks_to_one_worker(serve_app, stub):
    md = serve_app.metadata
    for session in ("alice", "bob"):
        workers = {_gen(stub, md, f"Turn {i} of {session}: tell me about cats.", session).worker_id
                   for i in range(4)}
        assert len(workers) == 1, (session, workers)


def test_shared_prefix_goes_to_the_worker_holding_it(serve_app, stub):
    md = serve_app.metadata
    prefix = "You are a helpful assistant that answers in one short sentence. " * 4
    first = _gen(stub, md, prefix + "What is the capital of Italy?")
    again = _gen(stub, md, prefix + "What is the capital of Spain?")
    assert again.worker_id == first.worker_id
    assert again.usage.cached_tokens >= 32  # the prefix blocks were reused on that worker


def test_mixed_load_spreads_over_both_workers(serve_app, stub):
    md = serve_app.metadata
    prompts = [f"Write a word about the number {i}." for i in range(8)]
    ex = ThreadPoolExecutor(8)
    try:
        # held, the workers finish nothing before all eight are routed: the picks see
        # each other's load, however fast or slow this machine serves one request
        with serve_app.held():
            known = serve_app.unfinished()
            futs = [ex.submit(lambda p=p: _gen(stub, md, p, n=8).worker_id) for p in prompts]
            deadline = time.monotonic() + 300
            while len(serve_app.unfinished() - known) < len(prompts):
                assert time.monotonic() < deadline, "the requests never all reached a worker"
                time.sleep(0.05)
        workers = [f.result(timeout=300) for f in futs]
    finally:
        ex.shutdown()
    counts = {w: workers.count(w) for w in set(workers)}
    assert set(counts) == {"worker-0", "worker-1"} and min(counts.values()) >= 3, counts
