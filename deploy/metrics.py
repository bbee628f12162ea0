"""The ingress's Prometheus metric: requests rejected before they reach a worker.

`kvserve_requests_rejected` (tags `model`, `reason`) counts the requests answered with an
error of the client's making or of overload: `invalid` (INVALID_ARGUMENT / 400, an unknown
model included), `auth` (UNAUTHENTICATED / 401) and `overload` (RESOURCE_EXHAUSTED / 429).
Failures of the service itself (UNAVAILABLE, INTERNAL) are not rejections. State lives in
this importable module: Serve copies the ingress module's globals by value (see auth.py).
"""

from __future__ import annotations

from typing import Any

from kvserve.deploy.errors import ServiceError
from kvserve.workers.metrics import zero

# ServiceError kind -> rejection reason
REASONS = {"invalid": "invalid", "not_found": "invalid", "unauthenticated": "auth",
           "overloaded": "overload"}

_counter: Any = None


def start(model: str, others: tuple[str, ...] = ()) -> None:
    """Create the counter in this (ingress replica) process, every reason at 0 for every
    base model (`model`: the first, the default tag)."""
    global _counter
    from ray.util.metrics import Counter

    _counter = Counter("kvserve_requests_rejected",
                       "requests rejected by the ingress, by reason (invalid, overload, auth)",
                       tag_keys=("model", "reason")).set_default_tags({"model": model})
    for reason in sorted(set(REASONS.values())):
        for m in (model, *others):
            zero(_counter, {"reason": reason, "model": m})


def rejected(err: ServiceError) -> None:
    """Count an error answered to a client, if it is a rejection."""
    reason = REASONS.get(err.kind)
    if reason is not None and _counter is not None:
        _counter.inc(tags={"reason": reason, **({"model": err.model} if err.model else {})})
