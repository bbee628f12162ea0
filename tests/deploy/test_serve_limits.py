"""Size limits and key checks at the front doors: 413 / RESOURCE_EXHAUSTED for oversized
requests, before any parsing or tokenizing; API keys compared in constant time."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from kvserve.deploy.auth import key_matches
from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

BIG = 5 * 1024 * 1024  # over the default max_request_bytes (4 MiB)


def test_key_matches_compares_every_key():
    assert key_matches("b", ["a", "b", "c"]) and not key_matches("d", ["a", "b"])
    assert not key_matches("", ["a"]) and not key_matches("a", [])
    assert key_matches("ключ", ["ключ"])


def _post(serve_app, data: bytes, chunked: bool = False) -> tuple[int, dict]:
    headers = {"content-type": "application/json", "authorization": f"Bearer {serve_app.api_key}"}
    body: object = data
    if chunked:  # no Content-Length: the limit must hold while the body is read
        body = iter([data[i:i + 65536] for i in range(0, len(data), 65536)])
        headers["transfer-encoding"] = "chunked"
    req = urllib.request.Request(serve_app.http_url + "/v1/completions", data=body,  # type: ignore[arg-type]
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_http_body_over_the_limit_is_413(serve_app, chunked):
    data = json.dumps({"prompt": "x " * (BIG // 2), "max_tokens": 1}).encode()
    status, body = _post(serve_app, data, chunked)
    assert status == 413, body
    assert "max_request_bytes" in body["error"]["message"]


def test_http_prompt_over_the_context_is_400(serve_app):
    status, body = _post(serve_app, json.dumps({"prompt": "hello " * 3000}).encode())
    assert status == 400 and "context" in body["error"]["message"]


def test_grpc_message_over_the_limit_is_resource_exhausted(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            stub.Generate(pb.GenerateRequest(prompt="x" * BIG), metadata=serve_app.metadata,
                          timeout=120)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value.details()
