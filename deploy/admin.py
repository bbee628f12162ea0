"""Operator actions behind the API key: draining a worker (gRPC DrainWorker and
HTTP POST /v1/admin/drain share this)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvserve.deploy.errors import ServiceError
from kvserve.deploy.service import Service

DEFAULT_DRAIN_TIMEOUT_S = 600.0


class DrainRequest(BaseModel):
    """Body of POST /v1/admin/drain."""

    model_config = ConfigDict(extra="forbid")

    worker: str | int
    timeout_s: float | None = None


def worker_index(svc: Service, worker: Any) -> int:
    """'worker-N' or N, checked against the served workers."""
    m = re.fullmatch(r"(?:worker-)?(\d+)", str(worker).strip()) if worker is not None else None
    idx = int(m.group(1)) if m else -1
    if not 0 <= idx < len(svc.workers):
        raise ServiceError("invalid", f"no worker {worker!r}; workers are worker-0.."
                                      f"worker-{len(svc.workers) - 1}")
    return idx


async def drain(svc: Service, worker: Any, timeout_s: float | None) -> dict[str, Any]:
    """Drain a worker; {"worker_id", "streams_moved", "sessions_moved", "drained"} once it
    has stopped."""
    idx = worker_index(svc, worker)
    timeout = DEFAULT_DRAIN_TIMEOUT_S if timeout_s is None else timeout_s
    if not timeout > 0:
        raise ServiceError("invalid", f"timeout_s must be positive, got {timeout}")
    res = await svc.router.drain.remote(idx, timeout)
    if "error" in res:
        raise ServiceError("unavailable", f"draining worker-{idx} failed: {res['error']}")
    return {"worker_id": f"worker-{idx}", "streams_moved": res["moved"],
            "sessions_moved": res.get("sessions", 0), "drained": True}
