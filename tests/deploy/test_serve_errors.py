"""Bad inputs over gRPC and HTTP get the right status and a message; the service keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

LONG_PROMPT = "hello " * 1100  # over the test app's 1024-token context
INVALID = grpc.StatusCode.INVALID_ARGUMENT

GRPC_CASES = {
    "empty prompt": (pb.GenerateRequest(prompt=""), INVALID, "empty"),
    "negative max_tokens": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=-1)), INVALID,
        "max_tokens"),
    "huge max_tokens": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2_000_000_000)),
        INVALID, "context"),
    "temperature NaN": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=float("nan"))),
        INVALID, "temperature"),
    "top_p > 1": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=1.5)), INVALID, "top_p"),
    "prompt over the context": (pb.GenerateRequest(prompt=LONG_PROMPT), INVALID, "context"),
    "token id outside the vocabulary": (
        pb.GenerateRequest(prompt_token_ids=[1, 10_000_000]), INVALID, "vocabulary"),
    "unknown model": (
        pb.GenerateRequest(model="gpt-17", prompt="hi"), grpc.StatusCode.NOT_FOUND, "gpt-17"),
    "too many logprobs": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(logprobs=21)), INVALID,
        "logprobs"),
}


@pytest.fixture(scope="module")
def channel(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        yield ch


def _still_serves(serve_app, channel) -> None:
    stub = kvserve_pb2_grpc.KVServeStub(channel)
    r = stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=2)),
                      metadata=serve_app.metadata, timeout=60)
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("case", sorted(GRPC_CASES))
@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_grpc_bad_input(serve_app, channel, case, streaming):
    req, code, word = GRPC_CASES[case]
    stub = kvserve_pb2_grpc.KVServeStub(channel)
    with pytest.raises(grpc.RpcError) as ei:
        if streaming:
            list(stub.GenerateStream(req, metadata=serve_app.metadata, timeout=60))
        else:
            stub.Generate(req, metadata=serve_app.metadata, timeout=60)
    assert ei.value.code() == code, ei.value.details()
    assert word in ei.value.details()


def test_grpc_invalid_utf8(serve_app, channel):
    # protobuf clients cannot even encode this, so send the raw bytes: field 2 (prompt)
    raw = b"\x12\x04\xff\xfeab" + pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2)) \
        .SerializeToString()
    call = channel.unary_unary("/kvserve.v1.KVServe/Generate", request_serializer=None,
                               response_deserializer=None)
    with pytest.raises(grpc.RpcError) as ei:
        call(raw, metadata=serve_app.metadata, timeout=60)
    assert ei.value.code() == INVALID and "UTF-8" in ei.value.details()
    _still_serves(serve_app, channel)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),)],
                         ids=["missing", "wrong"])
def test_grpc_api_key(serve_app, channel, metadata):
    stub = kvserve_pb2_grpc.KVServeStub(channel)
    for call in (lambda: stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=metadata),
                 lambda: list(stub.GenerateStream(pb.GenerateRequest(prompt="hi"),
                                                  metadata=metadata)),
                 lambda: stub.ListModels(pb.ListModelsRequest(), metadata=metadata)):
        with pytest.raises(grpc.RpcError) as ei:
            call()
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in ei.value.details()
    _still_serves(serve_app, channel)


# ---- HTTP -------------------------------------------------------------------------------------
def _post(serve_app, path: str, body: bytes | dict, key: str | None = "ok") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {serve_app.api_key if key == 'ok' else key}"
    req = urllib.request.Request(serve_app.http_url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


HTTP_CASES = {
    "empty prompt": ({"prompt": ""}, 400),
    "negative max_tokens": ({"prompt": "hi", "max_tokens": -1}, 400),
    "huge max_tokens": ({"prompt": "hi", "max_tokens": 10**12}, 400),
    "top_p > 1": ({"prompt": "hi", "top_p": 1.5}, 400),
    "prompt over the context": ({"prompt": LONG_PROMPT}, 400),
    "unknown model": ({"prompt": "hi", "model": "gpt-17"}, 404),
    "wrong type": ({"prompt": "hi", "max_tokens": "many"}, 400),
    "missing prompt": ({"max_tokens": 3}, 400),
    "too many logprobs": ({"prompt": "hi", "logprobs": 21}, 400),
    "n = 0": ({"prompt": "hi", "n": 0}, 400),
    "n over the limit": ({"prompt": "hi", "n": 17}, 400),
}


@pytest.mark.parametrize("case", sorted(HTTP_CASES))
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_http_bad_input(serve_app, case, stream):
    body, status = HTTP_CASES[case]
    code, out = _post(serve_app, "/v1/completions", {**body, "stream": stream})
    assert code == status, out
    assert out["error"]["message"] and out["error"]["code"] == status


def test_http_nan_invalid_utf8_and_chat(serve_app):
    code, out = _post(serve_app, "/v1/completions", b'{"prompt": "hi", "temperature": NaN}')
    assert code == 400 and "temperature" in out["error"]["message"]
    code, out = _post(serve_app, "/v1/completions", b'{"prompt": "\xff\xfe hi"}')
    assert code == 400, out
    code, out = _post(serve_app, "/v1/chat/completions", {"messages": []})
    assert code == 400 and "empty" in out["error"]["message"]
    code, out = _post(serve_app, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}], "top_p": 2})
    assert code == 400 and "top_p" in out["error"]["message"]


@pytest.mark.parametrize("key", [None, "wrong"], ids=["missing", "wrong"])
def test_http_api_key(serve_app, key):
    code, out = _post(serve_app, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=key)
    assert code == 401 and "API key" in out["error"]["message"]
    code, out = _post(serve_app, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert code == 200 and out["choices"][0]["text"] is not None


def test_openai_sdk_raises_typed_errors(serve_app):
    client = openai.OpenAI(base_url=serve_app.http_url + "/v1", api_key=serve_app.api_key,
                           max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="hi", max_tokens=3, top_p=7)
    bad = openai.OpenAI(base_url=serve_app.http_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="default", prompt="hi", max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=3)


def test_http_chat_logprobs_checks(serve_app):
    msgs = [{"role": "user", "content": "hi"}]
    code, out = _post(serve_app, "/v1/chat/completions",
                      {"messages": msgs, "top_logprobs": 2, "max_tokens": 2})
    assert code == 400 and "logprobs: true" in out["error"]["message"]
    code, out = _post(serve_app, "/v1/chat/completions",
                      {"messages": msgs, "logprobs": True, "top_logprobs": 50, "max_tokens": 2})
    assert code == 400 and "logprobs" in out["error"]["message"]
    code, out = _post(serve_app, "/v1/chat/completions",
                      {"messages": msgs, "logprobs": False, "max_tokens": 2})
    assert code == 200 and out["choices"][0]["message"]["content"] is not None
    assert out["choices"][0]["logprobs"] is None
