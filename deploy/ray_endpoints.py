"""Where an operator finds the Ray that kvserve runs on: its dashboard (and how to log in to
it) and its Prometheus metrics endpoint.

Read from the Ray this process is connected to, so a `kvserve serve` that joined a running
cluster reports that cluster's, and an ingress replica reports what Ray bound, not what
was asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


@dataclass
class RayEndpoints:
    dashboard_url: str  # "" when the cluster runs no dashboard
    metrics_host: str
    metrics_port: int  # Ray's metrics export port on this node (0: unknown)
    token_auth: bool  # the dashboard asks for Ray's token

    @property
    def metrics_url(self) -> str:
        return f"http://{self.metrics_host}:{self.metrics_port}/metrics"


def ray_endpoints() -> RayEndpoints:
    """The endpoints of the Ray this process is connected to (one GCS call)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n.get("NodeID") == node_id), {})
    return RayEndpoints(dashboard_url(), node.get("NodeManagerAddress", "127.0.0.1"),
                        int(node.get("MetricsExportPort") or 0), token_auth_enabled())


_known: RayEndpoints | None = None


def known_ray_endpoints() -> RayEndpoints:
    """ray_endpoints(), read once per process (they do not change while Ray runs)."""
    global _known
    if _known is None:
        _known = ray_endpoints()
    return _known


def dashboard_url() -> str:
    """The dashboard's address as it recorded it in the cluster when it bound (its host, its
    port); "" when the cluster runs none. ($RAY_OVERRIDE_DASHBOARD_URL wins, as in Ray.)"""
    url = os.environ.get("RAY_OVERRIDE_DASHBOARD_URL")
    if not url:
        from ray._private.services import get_webui_url_from_internal_kv

        try:
            url = get_webui_url_from_internal_kv() or ""
        except Exception:  # not connected: nothing to tell
            url = ""
    return url if not url or "://" in url else f"http://{url}"


def token_auth_enabled() -> bool:
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication
        return False
    return is_token_auth_enabled()


def token_hint() -> str:
    """How to get the token Ray's dashboard asks for (Ray reads it from $RAY_AUTH_TOKEN,
    then the file $RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token)."""
    if os.environ.get(TOKEN_ENV):
        return f"it asks for the token in ${TOKEN_ENV}"
    path = os.environ.get(TOKEN_PATH_ENV) or str(Path.home() / ".ray" / "auth_token")
    return f"it asks for a token: `ray get-auth-token` prints it; also in {path}"
