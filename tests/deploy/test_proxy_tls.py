"""kvserve's hook in Serve's proxies (deploy/proxy_tls.py) with Ray Serve's own server
builders, in this process: `start_grpc_server` and `start_asgi_http_server`, the functions
Serve's ProxyActor starts its two servers with (Ray 2.60), given the options and hook that
`kvserve serve` gives the proxies. Real TLS clients connect to them. No Ray cluster: the
whole service over TLS is tests/deploy/test_serve_tls.py (slow tier)."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import uvicorn.config
from ray.serve._private import default_impl
from ray.serve._private.grpc_util import start_grpc_server
from ray.serve._private.http_util import start_asgi_http_server
from ray.serve.config import HTTPOptions, gRPCOptions
from serve_fixtures import free_port
from tls_certs import PKI, make_pki

from kvserve.deploy import proxy_tls
from kvserve.deploy.app import GRPC_SERVICER
from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

MODELS = pb.ListModelsResponse(models=[pb.ModelInfo(id="the-model")])


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def hooked(monkeypatch) -> Iterator[Any]:
    """Runs the proxy hook as a proxy would, with what it patches restored after the test."""
    monkeypatch.setattr(default_impl, "add_grpc_address", default_impl.add_grpc_address)
    monkeypatch.setattr(uvicorn.config, "create_ssl_context", uvicorn.config.create_ssl_context)
    monkeypatch.setattr(proxy_tls, "_installed", False)
    monkeypatch.setattr(proxy_tls, "_health_started", False)
    for name in (proxy_tls.GRPC_CERT_ENV, proxy_tls.GRPC_KEY_ENV, proxy_tls.GRPC_CA_ENV,
                 proxy_tls.HEALTH_PORT_ENV):
        monkeypatch.delenv(name, raising=False)

    def install(env: dict[str, str]) -> list[Any]:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return proxy_tls.install()

    yield install


def _grpc_env(pki: PKI, ca: bool) -> dict[str, str]:
    env = {proxy_tls.GRPC_CERT_ENV: str(pki.server_cert),
           proxy_tls.GRPC_KEY_ENV: str(pki.server_key)}
    if ca:
        env[proxy_tls.GRPC_CA_ENV] = str(pki.ca)
    return env


# ---------------------------------------------------------------- gRPC


def _factory(service_method: str, streaming_type: Any) -> Any:
    """Stands in for Serve's gRPCProxy.service_handler_factory (which routes to replicas):
    answers ListModels with raw bytes, as a Serve replica's answer comes back."""
    async def handler(request: Any, context: Any) -> bytes:
        return MODELS.SerializeToString()

    return handler


async def _list_models(port: int, credentials: Any | None) -> Any:
    target = f"127.0.0.1:{port}"
    channel = (grpc.aio.secure_channel(target, credentials) if credentials is not None
               else grpc.aio.insecure_channel(target))
    async with channel:
        stub = kvserve_pb2_grpc.KVServeStub(channel)
        try:
            return await stub.ListModels(pb.ListModelsRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            return e


def _grpc_calls(pki: PKI, clients: dict[str, Any]) -> dict[str, Any]:
    """Serve's gRPC server started as its proxy starts it; each client's ListModels."""
    async def run() -> dict[str, Any]:
        port = free_port()
        options = gRPCOptions(port=port, grpc_servicer_functions=[GRPC_SERVICER])
        _, server = await start_grpc_server(_factory, options,
                                            event_loop=asyncio.get_running_loop())
        try:
            return {name: await _list_models(port, creds) for name, creds in clients.items()}
        finally:
            await server.stop(None)

    return asyncio.run(run())


def _creds(pki: PKI, cert: str | None = None) -> Any:
    if cert is None:
        return grpc.ssl_channel_credentials(pki.read("ca"))
    return grpc.ssl_channel_credentials(pki.read("ca"), pki.read(f"{cert}_key"),
                                        pki.read(f"{cert}_cert"))


def test_grpc_proxy_serves_tls(pki, hooked):
    assert hooked(_grpc_env(pki, ca=False)) == []
    out = _grpc_calls(pki, {"tls": _creds(pki), "plaintext": None,
                            "wrong CA": grpc.ssl_channel_credentials(pki.read("stranger_cert"))})
    assert out["tls"] == MODELS  # Serve's routing of the method is untouched
    assert out["plaintext"].code() == grpc.StatusCode.UNAVAILABLE
    assert out["wrong CA"].code() == grpc.StatusCode.UNAVAILABLE  # the server is not trusted


def test_grpc_proxy_with_a_ca_requires_a_client_certificate_it_signed(pki, hooked):
    hooked(_grpc_env(pki, ca=True))
    out = _grpc_calls(pki, {"client": _creds(pki, "client"), "none": _creds(pki),
                            "stranger": _creds(pki, "stranger"), "plaintext": None})
    assert out["client"] == MODELS
    for refused in ("none", "stranger", "plaintext"):
        assert isinstance(out[refused], grpc.aio.AioRpcError), refused
        assert out[refused].code() == grpc.StatusCode.UNAVAILABLE, refused


def test_grpc_proxy_stays_plaintext_without_the_files(pki, hooked):
    hooked({})
    out = _grpc_calls(pki, {"plaintext": None, "tls": _creds(pki)})
    assert out["plaintext"] == MODELS
    assert out["tls"].code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_hook_names_a_file_it_cannot_read(pki, hooked):
    with pytest.raises(RuntimeError, match=rf"\${proxy_tls.GRPC_CA_ENV}=/nonexistent: No such"):
        hooked(_grpc_env(pki, ca=False) | {proxy_tls.GRPC_CA_ENV: "/nonexistent"})


# ---------------------------------------------------------------- HTTP


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": f"hello {scope['path']}".encode()})


def _get(url: str, pki: PKI, cert: str | None = None) -> Any:
    ctx = ssl.create_default_context(cafile=str(pki.ca)) if url.startswith("https") else None
    if ctx is not None and cert:
        ctx.load_cert_chain(str(getattr(pki, f"{cert}_cert")), str(getattr(pki, f"{cert}_key")))
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (OSError, ssl.SSLError) as e:  # refused: the handshake, or the connection, ends
        return e


def _http_calls(pki: PKI, middlewares: list[Any], ca: bool,
                requests: dict[str, tuple[str, str | None]]) -> dict[str, Any]:
    """Serve's HTTP server started as its proxy starts it, with HTTPOptions' ssl_* files;
    each request's answer ((status, body), or the error)."""
    async def run() -> dict[str, Any]:
        port = free_port()
        options = HTTPOptions(host="127.0.0.1", port=port, ssl_certfile=str(pki.server_cert),
                              ssl_keyfile=str(pki.server_key),
                              ssl_ca_certs=str(pki.ca) if ca else None)
        options.middlewares.extend(middlewares)  # as Serve adds the hook's (in place)
        task, server = await start_asgi_http_server(_hello, options,
                                                    event_loop=asyncio.get_running_loop())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            loop = asyncio.get_running_loop()
            return {name: await loop.run_in_executor(
                None, _get, url.format(port=port), pki, cert)
                for name, (url, cert) in requests.items()}
        finally:
            server.should_exit = True
            await task

    return asyncio.run(run())


def test_serve_alone_does_not_ask_for_client_certificates(pki):
    """Ray 2.60's HTTP proxy with ssl_ca_certs, without kvserve's hook: uvicorn's default
    CERT_NONE, so a client without a certificate gets through (what the hook fixes)."""
    out = _http_calls(pki, [], ca=True, requests={"none": ("https://127.0.0.1:{port}/", None)})
    assert out["none"] == (200, "hello /")


def test_http_proxy_with_a_ca_requires_a_client_certificate_it_signed(pki, hooked):
    middlewares = hooked(_grpc_env(pki, ca=True))
    out = _http_calls(pki, middlewares, ca=True, requests={
        "client": ("https://127.0.0.1:{port}/v1/models", "client"),
        "none": ("https://127.0.0.1:{port}/v1/models", None),
        "stranger": ("https://127.0.0.1:{port}/v1/models", "stranger"),
        "plaintext": ("http://127.0.0.1:{port}/v1/models", None),
    })
    assert out["client"] == (200, "hello /v1/models")
    for refused in ("none", "stranger", "plaintext"):
        assert isinstance(out[refused], OSError), (refused, out[refused])


def test_http_proxy_without_a_ca_serves_any_client(pki, hooked):
    middlewares = hooked(_grpc_env(pki, ca=False))
    out = _http_calls(pki, middlewares, ca=False, requests={
        "none": ("https://127.0.0.1:{port}/", None),
        "plaintext": ("http://127.0.0.1:{port}/", None)})
    assert out["none"] == (200, "hello /")
    assert isinstance(out["plaintext"], OSError), out["plaintext"]


def test_health_port_answers_serves_health_check_in_plaintext(pki, hooked):
    """KubeRay's check of the head's Serve proxy: plain HTTP GET /-/healthz."""
    health = free_port()
    middlewares = hooked(_grpc_env(pki, ca=True) | {proxy_tls.HEALTH_PORT_ENV: str(health)})
    assert len(middlewares) == 1
    out = _http_calls(pki, middlewares, ca=True, requests={
        "health": (f"http://127.0.0.1:{health}/-/healthz", None),
        "other": (f"http://127.0.0.1:{health}/v1/models", None),
        "api": ("https://127.0.0.1:{port}/v1/models", "client"),
    })
    assert out["health"] == (200, "hello /-/healthz")  # the proxy's own answer
    assert out["other"] == (404, "only /-/healthz here")  # nothing else in plaintext
    assert out["api"] == (200, "hello /v1/models")
    from kvserve.deploy.serve_stop import port_in_use

    assert not port_in_use(health)  # closed with the proxy's loop, not left listening
