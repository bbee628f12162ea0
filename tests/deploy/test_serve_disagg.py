"""Disaggregated serving on the session's app (real Ray, Serve, gRPC and HTTP clients): its
two workers re-roled at run time (`router.set_roles`) as a prefill worker (worker-0) and a
decode worker (worker-1), then back to mixed. A long prompt runs on the prefill worker,
whose first token reaches the client at once, and the stream decodes on the decode worker:
the tokens are those the same app gives with mixed workers (colocated), on gRPC and HTTP,
streamed and unary, and the responses name both workers. A short prompt is prefilled where
it decodes. The roles show in GetServerInfo and /v1/server_info."""

from __future__ import annotations

import json
import time

import grpc
import pytest
import ray
import requests

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

# about 330 tokens: above the default disagg_min_prompt_tokens (16)
LONG = " ".join(f"Note {i}: the harbour master logged ship {i} arriving at dawn with cargo."
                for i in range(22))
SHORT = "The capital of France is"
MAX_TOKENS = 24


def _greedy() -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _http(serve_app, body: dict, stream: bool = False) -> requests.Response:
    return requests.post(f"{serve_app.http_url}/v1/completions",
                         json={"model": "default", "max_tokens": MAX_TOKENS, "temperature": 0,
                               "ignore_eos": True, **body, "stream": stream},
                         headers={"authorization": f"Bearer {serve_app.api_key}"},
                         stream=stream, timeout=300)


def _events(r: requests.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.iter_lines()
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


@pytest.fixture(scope="module")
def roled(serve_app):
    """The references on the mixed workers, then worker-0 prefill and worker-1 decode (the
    prefix rule off: the references leave the prompts cached on the decode worker); mixed
    again at the end."""
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        md = serve_app.metadata
        refs = {p: stub.Generate(pb.GenerateRequest(prompt=p, sampling=_greedy()), metadata=md)
                for p in (LONG, SHORT)}
        router = serve_app.router
        old = ray.get(router.set_roles.remote(["prefill", "decode"]))
        assert old == ["mixed", "mixed"]
        settings = ray.get(router.set_disagg.remote(local_prefix_share=2.0))
        try:
            yield stub, refs
        finally:
            ray.get(router.set_disagg.remote(**settings))
            ray.get(router.set_roles.remote(old))


def _handoffs(serve_app) -> dict:
    return serve_app.server_info()["disagg"]["handoffs"]


def test_grpc_long_prompt_prefilled_on_one_worker_decoded_on_the_other(serve_app, roled):
    stub, refs = roled
    md = serve_app.metadata
    before = _handoffs(serve_app).get("moved", 0)
    r = stub.Generate(pb.GenerateRequest(prompt=LONG, sampling=_greedy()), metadata=md)
    assert list(r.token_ids) == list(refs[LONG].token_ids) and r.text == refs[LONG].text
    assert r.prefill_worker_id == "worker-0" and r.worker_id == "worker-1"
    assert r.usage.prompt_tokens == refs[LONG].usage.prompt_tokens
    assert r.usage.completion_tokens == MAX_TOKENS
    chunks = list(stub.GenerateStream(pb.GenerateRequest(prompt=LONG, sampling=_greedy()),
                                      metadata=md))
    assert [t for c in chunks for t in c.delta_token_ids] == list(refs[LONG].token_ids)
    # the first token came from the prefill worker, on its own, then the decode worker's
    assert chunks[0].worker_id == "worker-0" and len(chunks[0].delta_token_ids) == 1
    assert all(c.worker_id == "worker-1" for c in chunks[1:])
    assert {c.prefill_worker_id for c in chunks} == {"worker-0"}
    assert chunks[-1].finish_reason == "length"
    assert _handoffs(serve_app)["moved"] - before == 2


def test_http_long_prompt_prefilled_on_one_worker_decoded_on_the_other(serve_app, roled):
    _, refs = roled
    ref = refs[LONG]
    r = _http(serve_app, {"prompt": LONG})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.text
    assert r.headers["x-kvserve-worker"] == "worker-1"
    assert r.headers["x-kvserve-prefill-worker"] == "worker-0"
    assert r.json()["kvserve_worker"] == "worker-1"
    s = _http(serve_app, {"prompt": LONG, "stream_options": {"include_usage": True}}, stream=True)
    assert s.headers["x-kvserve-worker"] == "worker-1"
    assert s.headers["x-kvserve-prefill-worker"] == "worker-0"
    events = _events(s)
    assert "".join(c["text"] for e in events for c in e["choices"]) == ref.text
    assert events[0]["kvserve_worker"] == "worker-0" and events[-2]["kvserve_worker"] == "worker-1"
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_short_prompt_is_prefilled_where_it_decodes(serve_app, roled):
    stub, refs = roled
    md = serve_app.metadata
    local = serve_app.server_info()["disagg"]["local_prefills"].get("short_prompt", 0)
    r = stub.Generate(pb.GenerateRequest(prompt=SHORT, sampling=_greedy()), metadata=md)
    assert list(r.token_ids) == list(refs[SHORT].token_ids)
    assert r.worker_id == r.prefill_worker_id == "worker-1"
    h = _http(serve_app, {"prompt": SHORT})
    assert h.headers["x-kvserve-worker"] == h.headers["x-kvserve-prefill-worker"] == "worker-1"
    assert h.json()["choices"][0]["text"] == refs[SHORT].text
    assert serve_app.server_info()["disagg"]["local_prefills"]["short_prompt"] - local == 2


def test_roles_show_in_server_info(serve_app, roled):
    stub, _ = roled
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=serve_app.metadata)
    assert {w.worker_id: w.role for w in info.workers} == {"worker-0": "prefill",
                                                           "worker-1": "decode"}
    http = requests.get(f"{serve_app.http_url}/v1/server_info",
                        headers={"authorization": f"Bearer {serve_app.api_key}"},
                        timeout=60).json()
    assert [w["role"] for w in http["workers"]] == ["prefill", "decode"]
    assert http["disagg"]["active"] and http["disagg"]["failure_policy"] == "recompute"
    # nothing left reserved or held once the requests are done
    deadline = time.monotonic() + 30
    while True:
        workers = serve_app.workers()
        held = [ray.get(w.handoffs.remote()) for w in workers]
        moves = [ray.get(w.live_moves.remote()) for w in workers]
        if all(h == {"prefilling": [], "held": []} for h in held) and \
                all(m == {"out": [], "in": []} for m in moves):
            break
        assert time.monotonic() < deadline, (held, moves)
        time.sleep(0.1)


def test_bad_roles_are_refused_at_run_time(serve_app, roled):
    router = serve_app.router
    for roles, why in ((["prefill", "prefill"], "at least one decode worker"),
                       (["decode", "decode"], "at least one prefill worker"),
                       (["prefill"], "1 roles for 2 workers"),
                       (["prefill", "cook"], "not one of")):
        with pytest.raises(ray.exceptions.RayTaskError, match=why):
            ray.get(router.set_roles.remote(roles))
    info = serve_app.server_info()
    assert [w["role"] for w in info["workers"]] == ["prefill", "decode"]
