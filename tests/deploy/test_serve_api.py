"""End to end through Ray Serve: generated gRPC stubs, the openai SDK, reflection (real model).

The greedy-text tests run per device: `cpu` on the session's app (two CPU workers), `cuda`
(skipped with "needs a CUDA GPU" where torch sees none) on an app that `kvserve serve`'s
arguments configure with one GPU worker in float32, against the offline engine on the same
GPU. The cuda case takes `KVSERVE_CUDA_TEST_MODEL` (an HF directory with its tokenizer) when
set, else the default model, and needs this process's Ray to itself: run it alone
(`pytest tests/deploy/test_serve_api.py -k cuda`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import openai
import pytest
import torch
from serve_fixtures import API_KEY, ServeApp, free_port

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc
from kvserve.sampling import SamplingParams

PROMPT = "The three primary colors are"
MAX_TOKENS = 12
CUDA_ENGINE = ["--kv-cache-tokens", "4096", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def stub(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        yield kvserve_pb2_grpc.KVServeStub(ch)


def _offline_texts(llm: Any) -> dict[str, str]:
    p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {
        "text": llm.generate([PROMPT], p)[0].text,
        "chat": llm.chat([{"role": "user", "content": "Name a fruit."}], p)[0].text,
    }


@pytest.fixture(scope="module")
def offline(smol_llm):
    return _offline_texts(smol_llm)


@dataclass
class Served:
    """A served app, its gRPC stub and the offline engine's greedy texts on its device."""

    device: str
    app: ServeApp
    stub: Any
    offline: dict[str, str]


@contextmanager
def _cuda_app() -> Iterator[tuple[ServeApp, Any]]:
    """`kvserve serve --gpus-per-worker 1 --dtype float32` (its arguments, its deploy), and
    the offline engine in float32 on the same GPU."""
    import ray

    if ray.is_initialized():
        pytest.skip("this process's Ray already serves the session's CPU app; run the cuda "
                    "case alone: -k cuda")
    from kvserve import LLM
    from kvserve.cli import build_parser
    from kvserve.deploy.serve_cli import config_from_args, deploy, shutdown
    from kvserve.models import default_model
    from kvserve.router.router import NAMESPACE, ROUTER_NAME

    model = os.environ.get("KVSERVE_CUDA_TEST_MODEL") or default_model()
    cfg = config_from_args(build_parser().parse_args([
        "serve", "--model", model, "--gpus-per-worker", "1", "--dtype", "float32", *CUDA_ENGINE,
        "--grpc-port", str(free_port()), "--http-port", str(free_port()), "--api-key", API_KEY]))
    deploy(cfg, ray_init={"include_dashboard": False, "log_to_driver": False},
           start_timeout_s=900)
    try:
        app = ServeApp(cfg.grpc_port, cfg.http_port, API_KEY,
                       ray.get_actor(ROUTER_NAME, namespace=NAMESPACE), cfg,
                       metadata=(("authorization", f"Bearer {API_KEY}"),))
        yield app, LLM(model, device="cuda", dtype="float32", kv_cache_tokens=4096,
                       max_model_len=1024)
    finally:
        shutdown(cfg)


@pytest.fixture(scope="module", params=[
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a CUDA GPU"))])
def served(request) -> Iterator[Served]:
    if request.param == "cpu":
        app = request.getfixturevalue("serve_app")
        with grpc.insecure_channel(app.grpc_target) as ch:
            yield Served("cpu", app, kvserve_pb2_grpc.KVServeStub(ch),
                         request.getfixturevalue("offline"))
        return
    with _cuda_app() as (app, llm), grpc.insecure_channel(app.grpc_target) as ch:
        yield Served("cuda", app, kvserve_pb2_grpc.KVServeStub(ch), _offline_texts(llm))


def _greedy(n: int = MAX_TOKENS) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=n)


def test_grpc_unary_and_stream_match_offline(served):
    serve_app, stub, offline = served.app, served.stub, served.offline
    md = serve_app.metadata
    # the worker runs on the device the case names (a GPU worker on cuda, not the CPU)
    assert serve_app.server_info()["model_info"]["device"] == served.device
    r = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_greedy()), metadata=md)
    assert r.text == offline["text"]
    assert r.finish_reason in ("length", "stop") and r.worker_id.startswith("worker-")
    assert r.usage.completion_tokens == len(r.token_ids) > 0
    assert r.usage.prompt_tokens > 0 and r.model

    chunks = list(stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, sampling=_greedy()),
                                      metadata=md))
    assert "".join(c.delta_text for c in chunks) == offline["text"]
    assert [t for c in chunks for t in c.delta_token_ids] == list(r.token_ids)
    assert all(not c.finish_reason for c in chunks[:-1]) and chunks[-1].finish_reason
    assert chunks[-1].usage.completion_tokens == len(r.token_ids)


def test_grpc_chat_matches_offline(serve_app, stub, offline):
    req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Name a fruit.")],
                         sampling=_greedy())
    assert stub.Chat(req, metadata=serve_app.metadata).text == offline["chat"]
    text = "".join(c.delta_text for c in stub.ChatStream(req, metadata=serve_app.metadata))
    assert text == offline["chat"]


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


def test_grpc_reflection_lists_the_service(serve_app):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        resp = next(iter(stub.ServerReflectionInfo(iter([req]), timeout=10)))
    names = {s.name for s in resp.list_services_response.service}
    assert "kvserve.v1.KVServe" in names


def test_http_openai_sdk_stream_matches_offline(served):
    serve_app, offline = served.app, served.offline
    client = openai.OpenAI(base_url=serve_app.http_url + "/v1", api_key=serve_app.api_key,
                           max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True)
    parts = [c.choices[0].text for c in stream if c.choices]
    assert "".join(parts) == offline["text"] and len(parts) > 1

    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == offline["text"] and r.usage.completion_tokens > 0

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(chat)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline["chat"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


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
    plain = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_greedy(4)),
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
