"""TLS of the two APIs: the files checked before anything starts, and what Serve's proxies
get (HTTPOptions' ssl_* files for HTTP; the environment of kvserve's proxy hook,
deploy/proxy_tls.py, for gRPC and for client certificates)."""

from __future__ import annotations

import os
import ssl
from typing import TYPE_CHECKING

from kvserve.deploy import proxy_tls
from kvserve.errors import ConfigError, StartupError

if TYPE_CHECKING:
    from kvserve.deploy.config import ServeConfig

# (ServeConfig field, `kvserve serve` flag)
CERT = ("ssl_certfile", "--ssl-certfile")
KEY = ("ssl_keyfile", "--ssl-keyfile")
CA = ("ssl_ca_certs", "--ssl-ca-certs")


def _name(what: tuple[str, str]) -> str:
    return f"{what[0]} ({what[1]})"


def _read(path: str, what: tuple[str, str]) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{_name(what)} {path}: {e.strerror or e}") from None


def check_files(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> None:
    """Raise ConfigError, naming the file and what is wrong, unless the certificate and its
    key load as a pair and the CA file holds certificates: a missing or unreadable file, one
    that is not PEM, a key with a passphrase (gRPC's server cannot take one) or a key that
    is not the certificate's."""
    if certfile is None and keyfile is None and ca_certs is None:
        return
    if certfile is None or keyfile is None:
        raise ConfigError(f"TLS needs both {_name(CERT)} and {_name(KEY)}")
    cert, key = _read(certfile, CERT), _read(keyfile, KEY)
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ConfigError(f"{_name(CERT)} {certfile}: no PEM certificate in it")
    if b"PRIVATE KEY-----" not in key:
        raise ConfigError(f"{_name(KEY)} {keyfile}: no PEM private key in it")
    if b"-----BEGIN ENCRYPTED PRIVATE KEY-----" in key or b"Proc-Type: 4,ENCRYPTED" in key:
        raise ConfigError(f"{_name(KEY)} {keyfile}: the key has a passphrase, which the gRPC "
                          "server cannot take; give it without one (openssl pkey -in KEY -out "
                          "PLAIN_KEY)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # the password callback only runs for an encrypted key (caught above)
        ctx.load_cert_chain(certfile, keyfile, password=lambda: b"")
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"{_name(KEY)} {keyfile} is not the key of {_name(CERT)} "
                              f"{certfile}") from None
        raise ConfigError(f"{_name(CERT)} {certfile} with {_name(KEY)} {keyfile}: "
                          f"{e.reason or e}") from None
    if ca_certs is not None:
        _read(ca_certs, CA)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=ca_certs)
        except ssl.SSLError as e:
            raise ConfigError(f"{_name(CA)} {ca_certs}: no PEM CA certificate in it "
                              f"({e.reason or e})") from None


def check(cfg: ServeConfig) -> None:
    """Everything about `cfg`'s TLS that can be refused before anything starts."""
    check_files(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs)
    proxy_env(cfg)


def http_options(cfg: ServeConfig) -> dict[str, str]:
    """Serve HTTPOptions' ssl_* fields (none without TLS)."""
    opts = {"ssl_certfile": cfg.ssl_certfile, "ssl_keyfile": cfg.ssl_keyfile,
            "ssl_ca_certs": cfg.ssl_ca_certs}
    return {k: v for k, v in opts.items() if v}


def proxy_env(cfg: ServeConfig) -> dict[str, str]:
    """The environment of Serve's proxies (through its controller's runtime_env): kvserve's
    proxy hook, with the gRPC server's files. Empty without TLS."""
    if not cfg.tls:
        return {}
    other = os.environ.get(proxy_tls.CALLBACK_ENV)
    if other and other != proxy_tls.CALLBACK:  # Serve takes one callback: it would be lost
        raise ConfigError(f"${proxy_tls.CALLBACK_ENV} is {other}, but TLS needs it for "
                          f"{proxy_tls.CALLBACK}, kvserve's hook in Serve's proxies")
    env = {proxy_tls.CALLBACK_ENV: proxy_tls.CALLBACK,
           proxy_tls.GRPC_CERT_ENV: str(cfg.ssl_certfile),
           proxy_tls.GRPC_KEY_ENV: str(cfg.ssl_keyfile)}
    if cfg.ssl_ca_certs:
        env[proxy_tls.GRPC_CA_ENV] = cfg.ssl_ca_certs
    return env


def check_running_serve(cfg: ServeConfig) -> None:
    """Serve that already ran on this Ray keeps its proxies' settings (serve.start only
    warns): refuse to go on when its HTTP proxy's TLS is not the one asked for."""
    from ray.serve.context import _get_global_client

    running = _get_global_client().http_config
    have = {k: getattr(running, k, None) or None for k in ("ssl_certfile", "ssl_ca_certs")}
    want = {"ssl_certfile": cfg.ssl_certfile, "ssl_ca_certs": cfg.ssl_ca_certs}
    if have != want:
        raise StartupError(f"Serve already runs on this Ray with other TLS settings ({have}, "
                           f"asked for {want}); its proxies keep them until Serve is shut down")


def exposure_warning(cfg: ServeConfig) -> str | None:
    """The banner's warning when the HTTP API binds an address other machines can reach with
    neither TLS nor an API key: anyone on the path can use the APIs and read what they carry."""
    cfg = cfg.with_proxy_defaults()  # unset fields: the addresses Serve's proxies bind
    if cfg.http_host in ("127.0.0.1", "localhost", "::1") or cfg.http_host.startswith("127."):
        return None
    if cfg.tls or cfg.resolved_api_keys():
        return None
    return (f"the APIs listen on {cfg.http_host} (HTTP :{cfg.http_port}; gRPC :{cfg.grpc_port} "
            "on every interface) with neither TLS nor an API key: anyone who can reach them "
            "can use them and read the traffic (--ssl-certfile/--ssl-keyfile, --api-key)")
