"""Runs inside Ray Serve's proxy actors: TLS for the gRPC proxy, client certificates required
by the HTTP proxy when it has a CA, and a plaintext health port for KubeRay.

Ray 2.60's gRPCOptions has no TLS setting, and its gRPC proxy binds its port with
`add_insecure_port`, through `ray.serve._private.default_impl.add_grpc_address`. Serve calls
the function named by $RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (its hook for HTTP
middlewares) in each proxy's constructor, before either server starts; `install` below is that
function. It swaps `add_grpc_address` for one that binds a TLS port (the same address, so
Serve's routing of each method to the ingress is untouched), and returns the middlewares.

On the HTTP side Serve passes HTTPOptions' ssl_* files to uvicorn, but never uvicorn's
`ssl_cert_reqs`, whose default (CERT_NONE) makes the server ask no client for a certificate
even with `ssl_ca_certs`: `install` makes a context with a CA require one.

The settings come from the environment (Serve's controller passes its own to the proxies it
starts: `serve.start(controller_options={"runtime_env": {"env_vars": ...}})`, or the
`controller_options` of a Serve config file); deploy/tls.py writes them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from typing import Any

log = logging.getLogger(__name__)

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "kvserve.deploy.proxy_tls.install"
GRPC_CERT_ENV = "KVSERVE_GRPC_SSL_CERTFILE"
GRPC_KEY_ENV = "KVSERVE_GRPC_SSL_KEYFILE"
GRPC_CA_ENV = "KVSERVE_GRPC_SSL_CA_CERTS"
HEALTH_PORT_ENV = "KVSERVE_PROXY_HEALTH_PORT"
HEALTH_PATH = "/-/healthz"

_installed = False
_health_started = False


def install() -> list[Any]:
    """Serve's proxy callback: patch this process once; the middlewares of the HTTP proxy."""
    global _installed
    if not _installed:
        _require_client_certificates()
        creds = grpc_server_credentials(os.environ)
        if creds is not None:
            _bind_grpc_with(creds)
        _installed = True
    port = os.environ.get(HEALTH_PORT_ENV)
    if not port:
        return []
    from starlette.middleware import Middleware

    return [Middleware(HealthPort, port=int(port))]


def grpc_server_credentials(env: dict[str, str] | Any) -> Any:
    """The gRPC server's TLS credentials from the environment; None without a certificate.
    With a CA, clients must present a certificate it signed (mutual TLS)."""
    import grpc

    cert, key, ca = env.get(GRPC_CERT_ENV), env.get(GRPC_KEY_ENV), env.get(GRPC_CA_ENV)
    if not cert and not key:
        return None
    if not (cert and key):
        raise RuntimeError(f"kvserve: gRPC TLS needs both ${GRPC_CERT_ENV} and ${GRPC_KEY_ENV}")
    pair = (_read(key, GRPC_KEY_ENV), _read(cert, GRPC_CERT_ENV))
    if not ca:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=_read(ca, GRPC_CA_ENV),
                                       require_client_auth=True)


def _read(path: str, env: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise RuntimeError(f"kvserve: gRPC TLS: ${env}={path}: {e.strerror or e}") from None


def _bind_grpc_with(creds: Any) -> None:
    from ray.serve._private import default_impl

    def add_grpc_address(grpc_server: Any, server_address: str) -> None:
        grpc_server.add_secure_port(server_address, creds)

    default_impl.add_grpc_address = add_grpc_address
    log.info("kvserve: Serve's gRPC proxy serves TLS%s",
             " and requires client certificates" if os.environ.get(GRPC_CA_ENV) else "")


def _require_client_certificates() -> None:
    import uvicorn.config

    make = uvicorn.config.create_ssl_context
    if getattr(make, "_kvserve", False):
        return

    def create_ssl_context(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        if kwargs.get("ca_certs"):
            kwargs["cert_reqs"] = ssl.CERT_REQUIRED
        return make(*args, **kwargs)

    create_ssl_context._kvserve = True  # type: ignore[attr-defined]
    uvicorn.config.create_ssl_context = create_ssl_context


class HealthPort:
    """Serve's own `/-/healthz` answer, in plaintext on a port of its own (nothing else there).

    KubeRay labels the head pod `ray.io/serve=true`, which the chart's Services select, only
    while GET http://<pod>:<container port `serve`>/-/healthz answers 200, in plain HTTP:
    with TLS on Serve's HTTP port that port is this one. The answer is the proxy's (draining,
    routes not yet known), asked of the ASGI app this middleware wraps."""

    def __init__(self, app: Any, port: int) -> None:
        global _health_started
        self.app = app
        if _health_started:  # once per process (a replica's direct ingress calls it too)
            return
        import socket

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:  # here, so that a port in use fails the proxy's start with this message
            sock.bind(("0.0.0.0", port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"kvserve: health port {port} (${HEALTH_PORT_ENV}): {e}") from e
        _health_started = True
        self._task = asyncio.get_running_loop().create_task(self._serve(sock))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)

    async def _health(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"only /-/healthz here"})

    async def _serve(self, sock: Any) -> None:
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(
            self._health, interface="asgi3", lifespan="off", access_log=False, log_config=None,
            log_level=None))
        server.install_signal_handlers = lambda: None  # not the main thread (as Serve does)
        try:
            await server.serve(sockets=[sock])
        finally:  # cancelled with its loop: the port must not outlive it
            sock.close()
