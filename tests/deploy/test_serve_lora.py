"""LoRA adapters through the served app (the session's two workers, real gRPC and HTTP
clients): loaded at run time behind the API key on every worker, listed with their parent
by /v1/models and ListModels, named in `model` on both APIs (the offline engine's tokens,
not the base model's), unknown names NOT_FOUND / 404, bad adapters INVALID_ARGUMENT / 400
with nothing loaded and the base still served, unloaded again."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
import ray
from lora_adapters import smollm2_adapter

from kvserve import LLM, SamplingParams
from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

PROMPT = "The three primary colors are"
N = 12


@pytest.fixture(scope="module")
def stub(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        yield kvserve_pb2_grpc.KVServeStub(ch)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("served_loras")
    return {"tone": smollm2_adapter(str(root / "tone"), 8, seed=5),
            "terse": smollm2_adapter(str(root / "terse"), 4, seed=6, targets=["q_proj", "v_proj"]),
            "too-big": smollm2_adapter(str(root / "big"), 16, seed=7)}  # the app's limit is 8


def post(app, path: str, body: dict, key: str | None = "default") -> tuple[int, str]:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {app.api_key if key == 'default' else key}"
    req = urllib.request.Request(app.http_url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def get(app, path: str) -> dict:
    req = urllib.request.Request(app.http_url + path,
                                 headers={"authorization": f"Bearer {app.api_key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def generate(stub, md, model: str) -> pb.GenerateResponse:
    return stub.Generate(pb.GenerateRequest(
        model=model, prompt=PROMPT,
        sampling=pb.SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)),
        metadata=md, timeout=300)


def test_lora_adapters_over_http_and_grpc(serve_app, stub, adapters):
    md = serve_app.metadata
    app = serve_app
    # behind the API key
    code, _ = post(app, "/v1/load_lora_adapter",
                   {"lora_name": "tone", "lora_path": adapters["tone"]}, key=None)
    assert code == 401
    code, body = post(app, "/v1/load_lora_adapter",
                      {"lora_name": "tone", "lora_path": adapters["tone"]})
    assert code == 200 and "tone" in body
    res = stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
        lora_name="terse", lora_path=adapters["terse"]), metadata=md, timeout=300)
    assert res.rank == 4 and sorted(res.modules) == ["q_proj", "v_proj"]
    # every worker has both
    for w in app.workers():
        assert {x["name"] for x in ray.get(w.list_loras.remote())} == {"tone", "terse"}
    # listed with their parent
    models = {m["id"]: m for m in get(app, "/v1/models")["data"]}
    base = app.config.model_name()
    assert models["tone"]["parent"] == base and models["tone"]["root"] == adapters["tone"]
    assert models[base]["parent"] is None and set(models) == {base, "tone", "terse"}
    listed = stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=60).models
    assert {(m.id, m.parent, m.lora_rank) for m in listed} == {
        (base, "", 0), ("tone", base, 8), ("terse", base, 4)}

    # named in `model`: the offline engine's tokens with the same adapter
    ref = LLM(None, kv_cache_tokens=2048, num_threads=1, host_cache_gib=0,
              loras={"tone": adapters["tone"], "terse": adapters["terse"]}, max_lora_rank=8)
    sp = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    want = {name: ref.generate(PROMPT, sp, lora=name)[0].token_ids
            for name in ("tone", "terse", None)}
    assert want["tone"] != want[None] and want["terse"] != want[None]
    for name in ("tone", "terse"):
        r = generate(stub, md, name)
        assert list(r.token_ids) == want[name] and r.model == name
    assert list(generate(stub, md, f"{base}:tone").token_ids) == want["tone"]  # Ray's form
    assert list(generate(stub, md, "").token_ids) == want[None]
    code, body = post(app, "/v1/completions", {"model": "tone", "prompt": PROMPT,
                                               "max_tokens": N, "temperature": 0,
                                               "ignore_eos": True})
    out = json.loads(body)
    assert code == 200 and out["model"] == "tone"
    assert out["choices"][0]["text"] == ref.generate(PROMPT, sp, lora="tone")[0].text

    # an unknown name
    code, body = post(app, "/v1/chat/completions", {
        "model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert code == 404 and "nope" in body
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, md, "nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

    # bad adapters: refused, nothing loaded anywhere, the service goes on
    code, body = post(app, "/v1/load_lora_adapter",
                      {"lora_name": "big", "lora_path": adapters["too-big"]})
    assert code == 400 and "max_lora_rank" in body
    with pytest.raises(grpc.RpcError) as e:
        stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="gone", lora_path="/no/such"),
                             metadata=md, timeout=300)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not exist" in e.value.details()
    code, body = post(app, "/v1/load_lora_adapter",
                      {"lora_name": "tone", "lora_path": adapters["terse"]})
    assert code == 400 and "already loaded" in body
    for w in app.workers():
        assert {x["name"] for x in ray.get(w.list_loras.remote())} == {"tone", "terse"}
    assert list(generate(stub, md, "tone").token_ids) == want["tone"]

    # unloaded: NOT_FOUND from then on, everywhere
    code, _ = post(app, "/v1/unload_lora_adapter", {"lora_name": "tone"})
    assert code == 200
    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="terse"), metadata=md,
                           timeout=60)
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, md, "tone")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    code, _ = post(app, "/v1/unload_lora_adapter", {"lora_name": "tone"})
    assert code == 404
    assert {m["id"] for m in get(app, "/v1/models")["data"]} == {base}
    for w in app.workers():
        assert ray.get(w.list_loras.remote()) == []
