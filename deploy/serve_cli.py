"""`kvserve serve`: start (or join) Ray, deploy the app with gRPC + HTTP, wait for Ctrl-C."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from typing import Any

from kvserve.deploy.app import APP_NAME, GRPC_SERVICER, build_app
from kvserve.deploy.config import ServeConfig


@dataclass
class Endpoints:
    grpc_target: str  # host:port for grpc channels
    http_url: str  # base URL of the OpenAI API (without /v1)


def deploy(cfg: ServeConfig, ray_init: dict[str, Any] | None = None) -> Endpoints:
    """Start a local Ray if none is running, start Serve on the configured ports, deploy."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    if not ray.is_initialized():
        ray.init(**(ray_init or {}))
    serve.start(
        http_options=HTTPOptions(host=cfg.http_host, port=cfg.http_port),
        grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]),
    )
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
    host = "127.0.0.1" if cfg.http_host in ("0.0.0.0", "::") else cfg.http_host
    return Endpoints(f"{host}:{cfg.grpc_port}", f"http://{host}:{cfg.http_port}")


def shutdown() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        if ray.is_initialized():
            ray.shutdown()


def serve_forever(cfg: ServeConfig) -> int:
    ep = deploy(cfg)
    print(f"kvserve: serving {cfg.model_name()} on {cfg.num_workers} worker(s)", flush=True)
    print(f"  gRPC  {ep.grpc_target}   (kvserve generate --server {ep.grpc_target} --prompt ...)")
    print(f"  HTTP  {ep.http_url}/v1   (OpenAI API: /v1/completions, /v1/chat/completions)")
    print("Ctrl-C to stop", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    print("kvserve: shutting down", flush=True)
    shutdown()
    return 0
