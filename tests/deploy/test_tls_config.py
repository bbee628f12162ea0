"""TLS settings of `kvserve serve` and `kvserve generate --server`: ServeConfig's checks, the
certificate files checked before anything starts, what Serve's proxies are given, the banner's
warning. No Ray: each refusal here happens before Ray starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tls_certs import PKI, make_pki

from kvserve.cli import build_parser, main
from kvserve.deploy import proxy_tls, tls
from kvserve.deploy.config import ServeConfig
from kvserve.deploy.serve_cli import config_from_args
from kvserve.errors import ConfigError


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _ray_up() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def test_serve_config_pairs_the_certificate_and_its_key(pki):
    cfg = ServeConfig(ssl_certfile=str(pki.server_cert), ssl_keyfile=str(pki.server_key),
                      ssl_ca_certs=str(pki.ca))
    assert cfg.tls
    assert not ServeConfig().tls
    with pytest.raises(ValueError, match=r"ssl_keyfile \(--ssl-keyfile\) needs ssl_certfile"):
        ServeConfig(ssl_keyfile=str(pki.server_key))
    with pytest.raises(ValueError, match=r"ssl_certfile \(--ssl-certfile\) needs ssl_keyfile"):
        ServeConfig(ssl_certfile=str(pki.server_cert))
    with pytest.raises(ValueError, match="ssl_ca_certs .* needs TLS"):
        ServeConfig(ssl_ca_certs=str(pki.ca))
    # a round trip (the ingress gets the config as a dict) keeps it
    assert ServeConfig(**cfg.model_dump()) == cfg


def test_relative_paths_become_absolute(pki, monkeypatch):
    """Serve's proxies do not run in the directory `kvserve serve` was started from."""
    monkeypatch.chdir(pki.ca.parent)
    cfg = ServeConfig(ssl_certfile="server.pem", ssl_keyfile="./server.key",
                      ssl_ca_certs="ca.pem")
    assert (cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs) == (
        str(pki.server_cert), str(pki.server_key), str(pki.ca))


def test_good_files_pass(pki):
    tls.check_files(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    tls.check_files(str(pki.server_cert), str(pki.server_key), None)
    tls.check_files(None, None, None)


@pytest.mark.parametrize("cert, key, ca, message", [
    ("missing.pem", "server_key", None,
     "ssl_certfile (--ssl-certfile) {cert}: No such file or directory"),
    ("server_cert", "missing.key", None,
     "ssl_keyfile (--ssl-keyfile) {key}: No such file or directory"),
    ("server_cert", "server_key", "missing-ca.pem",
     "ssl_ca_certs (--ssl-ca-certs) {ca}: No such file or directory"),
    ("folder", "server_key", None, "ssl_certfile (--ssl-certfile) {cert}: Is a directory"),
    ("server_key", "server_key", None, "{cert}: no PEM certificate in it"),
    ("server_cert", "server_cert", None, "{key}: no PEM private key in it"),
    ("server_cert", "other_key", None,
     "ssl_keyfile (--ssl-keyfile) {key} is not the key of ssl_certfile (--ssl-certfile) {cert}"),
    ("server_cert", "client_key", None, "{key} is not the key of"),
    ("server_cert", "encrypted_key", None,
     "{key}: the key has a passphrase, which the gRPC server cannot take"),
    ("server_cert", "server_key", "server_key",
     "ssl_ca_certs (--ssl-ca-certs) {ca}: no PEM CA certificate in it"),
    (None, "server_key", None, "TLS needs both ssl_certfile (--ssl-certfile) and ssl_keyfile"),
])
def test_bad_files_are_refused_naming_the_file(pki, cert, key, ca, message):
    folder = pki.ca.parent

    def path(name: str | None) -> str | None:
        if name is None:
            return None
        if name == "folder":
            return str(folder)
        return str(getattr(pki, name)) if hasattr(pki, name) else str(folder / name)

    paths = {"cert": path(cert), "key": path(key), "ca": path(ca)}
    with pytest.raises(ConfigError) as err:
        tls.check_files(**{"certfile": paths["cert"], "keyfile": paths["key"],
                           "ca_certs": paths["ca"]})
    assert message.format(**paths) in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["--ssl-keyfile", "{server_key}"], "ssl_keyfile (--ssl-keyfile) needs ssl_certfile"),
    (["--ssl-certfile", "{server_cert}"], "ssl_certfile (--ssl-certfile) needs ssl_keyfile"),
    (["--ssl-ca-certs", "{ca}"], "needs TLS: set ssl_certfile and ssl_keyfile too"),
    (["--ssl-certfile", "{server_cert}", "--ssl-keyfile", "{other_key}"],
     "is not the key of ssl_certfile"),
    (["--ssl-certfile", "{ca}/../nowhere.pem", "--ssl-keyfile", "{server_key}"],
     "nowhere.pem: No such file or directory"),
    (["--ssl-certfile", "{server_cert}", "--ssl-keyfile", "{encrypted_key}"],
     "the key has a passphrase"),
])
def test_serve_refuses_bad_tls_before_ray_starts(pki, capsys, args, message):
    ray_was_up = _ray_up()
    argv = ["serve", *[a.format(**{k: getattr(pki, k) for k in
                                   ("server_key", "server_cert", "ca", "other_key",
                                    "encrypted_key")}) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve: error: ") and "\n" not in err, err
    assert message in err, err
    assert _ray_up() == ray_was_up  # nothing started


def test_serve_flags_reach_the_config_and_the_proxies(pki):
    a = build_parser().parse_args([
        "serve", "--ssl-certfile", str(pki.server_cert), "--ssl-keyfile", str(pki.server_key),
        "--ssl-ca-certs", str(pki.ca)])
    cfg = config_from_args(a)
    assert (cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs) == (
        str(pki.server_cert), str(pki.server_key), str(pki.ca))
    # HTTP: Serve's own HTTPOptions fields
    assert tls.http_options(cfg) == {"ssl_certfile": str(pki.server_cert),
                                     "ssl_keyfile": str(pki.server_key),
                                     "ssl_ca_certs": str(pki.ca)}
    from ray.serve.config import HTTPOptions

    HTTPOptions(host="127.0.0.1", port=8000, **tls.http_options(cfg))  # Serve accepts them
    # gRPC and client certificates: kvserve's hook in the proxies, with the same files
    assert tls.proxy_env(cfg) == {
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "kvserve.deploy.proxy_tls.install",
        proxy_tls.GRPC_CERT_ENV: str(pki.server_cert), proxy_tls.GRPC_KEY_ENV: str(pki.server_key),
        proxy_tls.GRPC_CA_ENV: str(pki.ca)}
    plain = config_from_args(build_parser().parse_args(["serve"]))
    assert tls.http_options(plain) == {} and tls.proxy_env(plain) == {}


def test_another_proxy_callback_is_not_silently_replaced(pki, monkeypatch):
    cfg = ServeConfig(ssl_certfile=str(pki.server_cert), ssl_keyfile=str(pki.server_key))
    monkeypatch.setenv(proxy_tls.CALLBACK_ENV, "mine.middlewares")
    with pytest.raises(ConfigError, match="is mine.middlewares, but TLS needs it"):
        tls.proxy_env(cfg)
    assert tls.proxy_env(ServeConfig()) == {}  # without TLS it stays the user's
    monkeypatch.setenv(proxy_tls.CALLBACK_ENV, proxy_tls.CALLBACK)
    assert tls.proxy_env(cfg)[proxy_tls.CALLBACK_ENV] == proxy_tls.CALLBACK


def test_the_proxy_hook_is_importable_by_its_path():
    from ray._common.utils import import_attr

    assert import_attr(proxy_tls.CALLBACK) is proxy_tls.install


def test_banner_warns_of_an_exposed_plaintext_api_without_keys(pki, monkeypatch):
    monkeypatch.delenv("KVSERVE_API_KEYS", raising=False)
    assert tls.exposure_warning(ServeConfig()) is None  # loopback
    assert tls.exposure_warning(ServeConfig(http_host="127.0.0.2")) is None
    warning = tls.exposure_warning(ServeConfig(http_host="0.0.0.0"))
    assert warning and "0.0.0.0" in warning and "neither TLS nor an API key" in warning
    assert tls.exposure_warning(ServeConfig(http_host="10.1.2.3", api_keys=["k"])) is None
    assert tls.exposure_warning(ServeConfig(http_host="0.0.0.0", ssl_certfile=str(pki.server_cert),
                                        ssl_keyfile=str(pki.server_key))) is None
    monkeypatch.setenv("KVSERVE_API_KEYS", "from-env")
    assert tls.exposure_warning(ServeConfig(http_host="0.0.0.0")) is None


@pytest.mark.parametrize("args, message", [
    (["--tls"], "--tls: for a server (--server HOST:PORT) only"),
    (["--ca", "ca.pem", "--cert", "c.pem"], "--ca, --cert: for a server"),
    (["--server", "127.0.0.1:1", "--cert", "c.pem"], "--cert and --key go together"),
    (["--server", "127.0.0.1:1", "--key", "k.pem"], "--cert and --key go together"),
    (["--server", "127.0.0.1:1", "--ca", "/nonexistent/ca.pem"],
     "--ca /nonexistent/ca.pem: No such file or directory"),
])
def test_generate_tls_flags_are_checked(capsys, args, message):
    assert main(["generate", "--prompt", "x", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve: error: ") and message in err, err


def test_channel_credentials_read_the_files(pki):
    import grpc

    from kvserve.grpc_client import channel_credentials

    for creds in (channel_credentials(), channel_credentials(str(pki.ca)),
                  channel_credentials(str(pki.ca), str(pki.client_cert), str(pki.client_key))):
        assert isinstance(creds, grpc.ChannelCredentials)


def test_paths_of_the_test_pki_exist(pki):
    for name in PKI.__dataclass_fields__:
        assert Path(getattr(pki, name)).is_file(), name


def test_banner_lines(pki, monkeypatch, capsys):
    from kvserve.deploy import ray_endpoints, serve_cli

    monkeypatch.delenv("KVSERVE_API_KEYS", raising=False)
    monkeypatch.setattr(ray_endpoints, "ray_endpoints",
                        lambda: ray_endpoints.RayEndpoints("", "127.0.0.1", 8080, False))
    files = {"ssl_certfile": str(pki.server_cert), "ssl_keyfile": str(pki.server_key)}
    serve_cli._print_banner(ServeConfig(http_host="0.0.0.0"),
                            serve_cli.Endpoints("127.0.0.1:9000", "http://127.0.0.1:8000"), {})
    out = capsys.readouterr().out
    assert "  HTTP       http://127.0.0.1:8000/v1   (OpenAI API" in out
    (warning,) = [ln for ln in out.splitlines() if ln.startswith("  WARNING    ")]
    assert "listen on 0.0.0.0" in warning and "neither TLS nor an API key" in warning
    serve_cli._print_banner(ServeConfig(http_host="0.0.0.0", **files, ssl_ca_certs=str(pki.ca)),
                            serve_cli.Endpoints("127.0.0.1:9000", "https://127.0.0.1:8000"), {})
    out = capsys.readouterr().out
    assert "  HTTP       https://127.0.0.1:8000/v1   (TLS, client certificates required; " in out
    assert "(TLS, client certificates required; kvserve generate --server 127.0.0.1:9000 " \
           "--tls --cert CERT.pem --key KEY.pem --prompt" in out
    assert "WARNING" not in out
    serve_cli._print_banner(ServeConfig(**files),
                            serve_cli.Endpoints("127.0.0.1:9000", "https://127.0.0.1:8000"), {})
    out = capsys.readouterr().out
    assert "(TLS; OpenAI API" in out and "--server 127.0.0.1:9000 --tls --prompt" in out


def test_banner_names_each_models_context(monkeypatch, capsys):
    from kvserve.deploy import ray_endpoints, serve_cli

    monkeypatch.setattr(ray_endpoints, "ray_endpoints",
                        lambda: ray_endpoints.RayEndpoints("", "127.0.0.1", 8080, False))
    served = {"kvserve-router": 8192, "kvserve-model1-router": 2048}
    monkeypatch.setattr(serve_cli, "_served_context", served.get)
    ep = serve_cli.Endpoints("127.0.0.1:9000", "http://127.0.0.1:8000")
    serve_cli._print_banner(ServeConfig(model="org/a"), ep, {})
    assert "org/a on 1 worker(s), context 8192 tokens (prompt + max_tokens)\n" in capsys.readouterr().out
    serve_cli._print_banner(ServeConfig(model=["org/a", "org/b"]), ep, {})
    out = capsys.readouterr().out
    assert ", context org/a 8192, org/b 2048 tokens (prompt + max_tokens)\n" in out, out
    del served["kvserve-router"]  # (a router that did not answer: its model is left out)
    serve_cli._print_banner(ServeConfig(model=["org/a", "org/b"]), ep, {})
    assert ", context org/b 2048 tokens" in capsys.readouterr().out


def test_serve_config_errors_of_the_flags_are_one_line(capsys):
    assert main(["serve", "--gpus-per-worker", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kvserve: error: num_gpus_per_worker: Input should be greater than or equal "
                   "to 0"), err
