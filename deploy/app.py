"""Importable builder of the Serve application (for `serve run`, `serve deploy`, `kvserve serve`).

    serve run deploy/serve_config.yaml
    serve run kvserve.deploy.app:build_app num_workers=2 \
        --grpc-servicer-functions kvserve.deploy.grpc_servicer.add_KVServeServicer_to_server
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.deploy.config import ServeConfig

if TYPE_CHECKING:  # Ray loads only when an app is built, not for `kvserve --help`
    from ray.serve import Application

APP_NAME = "kvserve"
# the generated add_KVServeServicer_to_server, registered so unparsable requests get a clear
# INVALID_ARGUMENT (see grpc_servicer.py)
GRPC_SERVICER = "kvserve.deploy.grpc_servicer.add_KVServeServicer_to_server"


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Build from a ServeConfig dict (`serve run` passes CLI key=value pairs as strings)."""
    from kvserve.deploy.ingress import KVServeIngress
    from kvserve.deploy.shutdown import serve_timeouts

    cfg = args if isinstance(args, ServeConfig) else ServeConfig(**_coerce(args or {}))
    # a replica that Serve stops (app deleted, or replaced by a redeploy) keeps serving its
    # requests in flight for up to shutdown_grace_s (and a margin) before it is killed
    return KVServeIngress.options(**serve_timeouts(cfg.shutdown_grace_s)).bind(cfg.model_dump())


def _coerce(args: dict[str, Any]) -> dict[str, Any]:
    """`serve run app key=value` gives strings; parse JSON-looking values (numbers, lists, dicts)."""
    import json

    out = {}
    for k, v in args.items():
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                pass
        out[k] = v
    return out
