"""End to end through Ray Serve: generated gRPC stubs, the openai SDK, reflection (real model).

The greedy-text checks (`served_checks.py`) run here on the session's CPU app and in
`test_serve_gpu.py` on a GPU worker."""

from __future__ import annotations

import json
import urllib.request

import grpc
import openai
import pytest
from served_checks import (
    MAX_TOKENS,
    PROMPT,
    check_grpc_greedy,
    check_http_greedy,
    greedy,
    offline_texts,
)

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc
from kvserve.sampling import SamplingParams


@pytest.fixture(scope="module")
def stub(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        yield kvserve_pb2_grpc.KVServeStub(ch)


@pytest.fixture(scope="module")
def offline(smol_llm):
    return offline_texts(smol_llm)


def test_grpc_generate_and_chat_match_offline(serve_app, stub, offline):
    check_grpc_greedy(serve_app, stub, offline, "cpu")


def test_grpc_info_methods(serve_app, stub):
    md = serve_app.metadata
    models = stub.ListModels(pb.ListModelsRequest(), metadata=md).models
    assert len(models) == 1 and models[0].max_model_len == 1024
    tok = stub.Tokenize(pb.TokenizeRequest(prompt=PROMPT), metadata=md)
    assert tok.count == len(tok.token_ids) > 0
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md)
    assert sorted(w.worker_id for w in info.workers) == ["worker-0", "worker-1"]
    assert all(w.total_device_blocks == 256 for w in info.workers)
    assert "kv_blocks_free" in info.workers[0].stats and info.routing_policy == "affinity"
    assert info.max_model_len == 1024
    # what each engine runs, as its start-up log says: the CPU kernels built on this host
    for w in info.workers:
        assert w.runtime["attention"] == "torch, prompt and decode rows in the C kernel", dict(w.runtime)
        assert w.runtime["linears"].startswith("quantized blocks x 8-bit activations"), dict(w.runtime)
        # the session's app enables LoRA: the one-call step would skip the adapters
        assert w.runtime["decode_step"] == "op by op: LoRA adapters run op by op", dict(w.runtime)
        assert "cuda_graphs" not in w.runtime
    # the host tier's cost model: measured at each worker's start-up, every decision listed
    for w in info.workers:
        ht = w.host_tier
        assert ht.restore_policy == "copy"  # serve_fixtures.ENGINE
        assert ht.copy_gbps_d2h > 0 and ht.copy_gbps_h2d > 0 and ht.prefill_tokens_per_s > 0
        assert "copy/cheaper_to_copy" in ht.restores and "recompute/not_on_host" in ht.restores
        assert w.stats["host_copy_gbps_h2d"] == pytest.approx(ht.copy_gbps_h2d)
    req = urllib.request.Request(serve_app.http_url + "/v1/server_info",
                                 headers={"authorization": f"Bearer {serve_app.api_key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        http = json.loads(r.read())
    assert http["max_model_len"] == 1024
    for w in http["workers"]:
        assert w["runtime"]["attention"] == "torch, prompt and decode rows in the C kernel"
        assert w["host_tier"]["restore_policy"] == "copy" and w["host_tier"]["prefill_tokens_per_s"] > 0
        assert set(w["host_tier"]["restores"]) == set(ht.restores)


def test_grpc_reflection_lists_the_service(serve_app):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        resp = next(iter(stub.ServerReflectionInfo(iter([req]), timeout=10)))
    names = {s.name for s in resp.list_services_response.service}
    assert "kvserve.v1.KVServe" in names


def test_http_openai_sdk_stream_matches_offline(serve_app, offline):
    check_http_greedy(serve_app, offline)


def test_http_health(serve_app):
    import json
    import urllib.request

    with urllib.request.urlopen(serve_app.http_url + "/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["workers_alive"] == 2


def test_grpc_logprobs_match_the_offline_engine(serve_app, stub, smol_llm):
    p = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    want = smol_llm.generate([PROMPT], p)[0]
    sampling = pb.SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    r = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=sampling),
                      metadata=serve_app.metadata)
    assert [x.token_id for x in r.logprobs] == list(r.token_ids) == want.token_ids
    assert [x.logprob for x in r.logprobs] == pytest.approx(want.logprobs, abs=1e-3)
    for x, top in zip(r.logprobs, want.top_logprobs, strict=True):
        assert [a.token_id for a in x.top_logprobs] == [a for a, _ in top]
        assert x.top_logprobs[0].token_id == x.token_id  # greedy: the best one was chosen
        assert x.token and x.top_logprobs[1].token
    # streamed: the same figures, split over the chunks, and none when not asked for
    chunks = list(stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, sampling=sampling),
                                      metadata=serve_app.metadata))
    assert [x.logprob for c in chunks for x in c.logprobs] == pytest.approx(
        [x.logprob for x in r.logprobs], abs=1e-5)
    plain = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=greedy(4)),
                          metadata=serve_app.metadata)
    assert len(plain.logprobs) == 0


def test_http_completion_and_chat_logprobs(serve_app):
    client = openai.OpenAI(base_url=serve_app.http_url + "/v1", api_key=serve_app.api_key)
    c = client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=3)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text
    assert len(lp.token_logprobs) == c.usage.completion_tokens == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(d) <= 3 and max(d.values()) == pytest.approx(x, abs=1e-5)
               for d, x in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True})
    entries, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].logprobs is not None:
            entries.extend(chunk.choices[0].logprobs.content)
    assert usage is not None and len(entries) == usage.completion_tokens == 6
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)
    assert all(bytes(e.bytes).decode("utf-8") == e.token for e in entries)


def test_http_n_choices(serve_app, offline):
    """`n`: that many choices, indexed; greedy ones equal the offline text; a seed repeats
    sampled ones; the usage counts the prompt once and every choice's tokens."""
    client = openai.OpenAI(base_url=serve_app.http_url + "/v1", api_key=serve_app.api_key,
                           max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.text == offline["text"] for c in r.choices)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=MAX_TOKENS, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True})
    texts, finished, roles, usage = {0: "", 1: ""}, {}, {}, None
    for c in stream:
        usage = c.usage or usage
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            roles.setdefault(ch.index, ch.delta.role)  # each choice's first delta has the role
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert texts == {0: offline["chat"], 1: offline["chat"]}
    assert roles == {0: "assistant", 1: "assistant"} and set(finished) == {0, 1}
    assert usage is not None and usage.completion_tokens % 2 == 0 and usage.completion_tokens > 0

    def sampled() -> list[str]:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                        seed=7, n=2, extra_body={"ignore_eos": True})
        return [c.text for c in out.choices]

    assert sampled() == sampled()  # choice i samples with seed + i: repeatable
