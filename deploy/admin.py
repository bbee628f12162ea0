"""Operator actions behind the API key: draining a worker (gRPC DrainWorker and
HTTP POST /v1/admin/drain share this) and moving a stream (MoveStream, POST /v1/admin/move)."""

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
    model: str | None = None  # the base model whose worker it is (none: the first)


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


class MoveRequest(BaseModel):
    """Body of POST /v1/admin/move."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    worker_id: str | int | None = None  # the target; None or "": the router picks
    stop_and_copy: bool = False
    model: str | None = None  # the base model that serves the stream (none: the first)


MOVE_CODES = {"not_found": "not_found", "invalid": "invalid", "no_room": "conflict"}


async def move(svc: Service, request_id: str, worker: Any, stop_and_copy: bool = False,
               ) -> dict[str, Any]:
    """Move a stream: {"request_id", "from_worker", "to_worker", "method", "stall_ms",
    "bytes", "rounds"} once it runs (or waits) on its new worker."""
    if not request_id:
        raise ServiceError("invalid", "request_id is required")
    idx = None if worker in (None, "") else worker_index(svc, worker)
    res = await svc.router.move_request.remote(request_id, idx,
                                               "snapshot" if stop_and_copy else "auto")
    if "error" in res:
        raise ServiceError(MOVE_CODES.get(res.get("code", ""), "unavailable"),
                           f"moving {request_id!r} failed: {res['error']}")
    return {"request_id": request_id, "from_worker": res["src_worker"],
            "to_worker": res["dst_worker"], "method": res["method"],
            "stall_ms": round(float(res.get("stall_ms", 0.0)), 3),
            "bytes": int(res.get("bytes", 0)), "rounds": int(res.get("rounds", 0))}
