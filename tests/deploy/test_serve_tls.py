"""`kvserve serve` over TLS, the whole service: a real command with certificates the test
made, the `openai` SDK over https with the test CA, gRPC secure channels, `kvserve generate
--server --tls`. With --ssl-ca-certs a client without a certificate (or with one another CA
signed) is refused on both APIs and one with a certificate the CA signed gets through;
plaintext to a TLS port fails at once. (The hook in Serve's proxies, without a cluster:
tests/deploy/test_proxy_tls.py; the refusals before start: tests/deploy/test_tls_config.py.)"""

from __future__ import annotations

import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
from serve_fixtures import free_port
from serve_process import ServeProcess
from tls_certs import PKI, make_pki

from kvserve.deploy.proxy_tls import HEALTH_PORT_ENV
from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

pytestmark = pytest.mark.slow  # two `kvserve serve` commands (README: the two commands)

MESSAGES = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _serve(pki: PKI, *extra: str, env: dict[str, str] | None = None) -> Iterator[Any]:
    sp = ServeProcess("--ssl-certfile", str(pki.server_cert), "--ssl-keyfile",
                      str(pki.server_key), *extra, env=env)
    try:
        sp.endpoints = sp.wait_ready()
        yield sp
    finally:
        sp.signal(signal.SIGTERM)
        try:
            assert sp.wait_exit(sp.grace_s + 60) == 0, sp.output[-3000:]
        finally:
            sp.kill()


def _openai(sp: ServeProcess, pki: PKI, cert: str | None) -> openai.OpenAI:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert:
        ctx.load_cert_chain(str(getattr(pki, f"{cert}_cert")), str(getattr(pki, f"{cert}_key")))
    return openai.OpenAI(base_url=sp.endpoints["http"], api_key="unused", max_retries=0,
                         timeout=120, http_client=openai.DefaultHttpxClient(verify=ctx))


def _chat(client: openai.OpenAI) -> str:
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4,
                                       temperature=0)
    return r.choices[0].message.content or ""


def _generate(sp: ServeProcess, credentials: Any | None) -> Any:
    target = sp.endpoints["grpc"]
    ch = (grpc.secure_channel(target, credentials) if credentials is not None
          else grpc.insecure_channel(target))
    with ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        req = pb.GenerateRequest(prompt="The capital of France is",
                                 sampling=pb.SamplingParams(max_tokens=4, temperature=0))
        try:
            return stub.Generate(req, timeout=120)
        except grpc.RpcError as e:
            return e


def _creds(pki: PKI, cert: str | None = None) -> Any:
    if cert is None:
        return grpc.ssl_channel_credentials(pki.read("ca"))
    return grpc.ssl_channel_credentials(pki.read("ca"), pki.read(f"{cert}_key"),
                                        pki.read(f"{cert}_cert"))


def _refused_quickly(call: Any) -> Any:
    """The error of a call that must fail, and fail without waiting for a timeout."""
    t0 = time.monotonic()
    out = call()
    assert time.monotonic() - t0 < 30
    return out


class TestMutualTLS:
    @pytest.fixture(scope="class")
    def served(self, pki) -> Iterator[ServeProcess]:
        health = free_port()
        for sp in _serve(pki, "--ssl-ca-certs", str(pki.ca), env={HEALTH_PORT_ENV: str(health)}):
            sp.health_port = health
            yield sp

    def test_banner_says_https_and_tls(self, served):
        assert served.endpoints["http"] == f"https://127.0.0.1:{served.http_port}/v1"
        out = "\n".join(served.lines)
        assert "TLS, client certificates required; OpenAI API" in out
        assert "TLS, client certificates required; kvserve generate" in out
        assert not [ln for ln in served.lines if ln.startswith("  WARNING")]

    def test_openai_sdk_with_a_certificate_the_ca_signed(self, served, pki):
        client = _openai(served, pki, "client")
        assert [m.id for m in client.models.list().data]
        assert _chat(client)

    @pytest.mark.parametrize("cert", [None, "stranger"])
    def test_openai_sdk_without_a_good_certificate_is_refused(self, served, pki, cert):
        with pytest.raises(openai.APIConnectionError):
            _refused_quickly(lambda: _chat(_openai(served, pki, cert)))

    def test_plaintext_http_to_the_tls_port_fails_cleanly(self, served):
        url = f"http://127.0.0.1:{served.http_port}/v1/models"
        with pytest.raises(OSError):  # the connection ends: no answer, no hang
            _refused_quickly(lambda: urllib.request.urlopen(url, timeout=30).read())

    def test_grpc_with_a_certificate_the_ca_signed(self, served, pki):
        out = _generate(served, _creds(pki, "client"))
        assert isinstance(out, pb.GenerateResponse), out
        assert out.text and out.worker_id

    @pytest.mark.parametrize("cert", [None, "stranger", "plaintext"])
    def test_grpc_without_a_good_certificate_is_refused(self, served, pki, cert):
        creds = None if cert == "plaintext" else _creds(pki, cert)
        out = _refused_quickly(lambda: _generate(served, creds))
        assert isinstance(out, grpc.RpcError) and out.code() == grpc.StatusCode.UNAVAILABLE, out

    def test_kvserve_generate_with_tls_flags(self, served, pki, capsys):
        from kvserve.cli import main

        base = ["generate", "--server", served.endpoints["grpc"], "--prompt",
                "The capital of France is", "--max-tokens", "4", "--ca", str(pki.ca)]
        assert main([*base, "--cert", str(pki.client_cert), "--key", str(pki.client_key)]) == 0
        out = capsys.readouterr()
        assert out.out.strip() and "served by worker-" in out.err
        assert main(base) == 1  # no client certificate
        assert "kvserve: error: UNAVAILABLE" in capsys.readouterr().err

    def test_health_port_answers_kuberays_check_in_plaintext(self, served):
        url = f"http://127.0.0.1:{served.health_port}/-/healthz"
        with urllib.request.urlopen(url, timeout=30) as r:
            assert (r.status, r.read()) == (200, b"success")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{served.health_port}/v1/models", timeout=30)
        assert err.value.code == 404


class TestServerTLS:
    @pytest.fixture(scope="class")
    def served(self, pki) -> Iterator[ServeProcess]:
        yield from _serve(pki)

    def test_openai_sdk_over_https_with_the_test_ca(self, served, pki):
        assert served.endpoints["http"].startswith("https://")
        assert "TLS; OpenAI API" in "\n".join(served.lines)
        assert _chat(_openai(served, pki, None))

    def test_grpc_secure_channel(self, served, pki):
        out = _generate(served, _creds(pki))
        assert isinstance(out, pb.GenerateResponse), out
        assert out.text

    def test_plaintext_is_refused_on_both_ports(self, served):
        out = _refused_quickly(lambda: _generate(served, None))
        assert isinstance(out, grpc.RpcError) and out.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(OSError):
            _refused_quickly(lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{served.http_port}/v1/models", timeout=30).read())
