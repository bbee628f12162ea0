"""The app's own port settings against the proxies Ray Serve actually runs.

Serve owns the HTTP and gRPC proxies: `kvserve serve` starts them on ServeConfig's
`http_host` / `http_port` / `grpc_port`, but under `serve run` / `serve deploy` (and KubeRay)
the config file's `http_options` / `grpc_options` do (TLS files included), and the
application's args cannot move them. Left unset (None), those fields follow Serve's; set to something else, the app refuses
to start and names the setting that decides, rather than run on other ports than it says.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvserve.deploy.config import ServeConfig
from kvserve.errors import StartupError


def mismatches(cfg: ServeConfig, http: Any, grpc: Any) -> list[str]:
    """What the app's settings say and the proxies do not (Serve's HTTPOptions, gRPCOptions)."""
    out = []
    if cfg.http_port is not None and cfg.http_port != http.port:
        out.append(f"http_port={cfg.http_port}, but Serve's HTTP proxy listens on port "
                   f"{http.port} (http_options.port)")
    if cfg.http_host is not None and cfg.http_host != http.host:
        out.append(f"http_host={cfg.http_host!r}, but Serve's HTTP proxy binds {http.host!r} "
                   "(http_options.host)")
    for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):  # TLS the proxy does not serve
        mine, theirs = getattr(cfg, name, None), getattr(http, name, None)
        if mine and mine != theirs:
            out.append(f"{name}={mine!r}, but Serve's HTTP proxy has {theirs!r} "
                       f"(http_options.{name})")
    if cfg.grpc_port is not None and cfg.grpc_port != grpc.port:
        out.append(f"grpc_port={cfg.grpc_port}, but Serve's gRPC proxy listens on port "
                   f"{grpc.port} (grpc_options.port)")
    return out


async def check_proxies(cfg: ServeConfig) -> None:
    """Raise StartupError when the app's port settings are not what Serve's proxies use."""
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    http, grpc = await asyncio.gather(controller.get_http_config.remote(),
                                      controller.get_grpc_config.remote())
    bad = mismatches(cfg, http, grpc)
    if bad:
        raise StartupError(
            "the app's settings do not match Ray Serve's proxies: " + "; ".join(bad) + ". Under "
            "`serve run` / `serve deploy` the proxies are set by the config file's http_options "
            "and grpc_options: set the ports, host and TLS files there (docs/serving.md, "
            "\"Security\", for gRPC's TLS), and leave them out of the app's args (or give the "
            "same values)")
