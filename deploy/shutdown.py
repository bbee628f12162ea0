"""Graceful shutdown of an ingress replica: requests in flight get a stated grace period.

When Serve stops a replica (its app deleted by `serve delete`, `serve shutdown` or a stopped
`kvserve serve`, or the replica replaced by a redeploy), it stops sending it requests and
waits up to the deployment's `graceful_shutdown_timeout_s` for those it runs, then kills it,
cutting whatever is left. kvserve sets that timeout to `shutdown_grace_s` plus a margin, and
this watch ends the requests still running at `shutdown_grace_s` itself, with a clear
UNAVAILABLE / 503, inside the margin, so no client sees a cut connection. Serve tells a
replica nothing when its shutdown starts, so the watch reads the replica's state from
Serve's controller while requests run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvserve.deploy.service import Service

log = logging.getLogger(__name__)

POLL_S = 2.0  # how often the replica's state is read while it has requests
# Serve's graceful_shutdown_timeout_s = shutdown_grace_s + this: covers the status poll and
# the aborted requests' answers reaching their clients
MARGIN_S = 15.0
STOPPING = ("STOPPING", "STOPPED")  # Serve's replica states once it is told to stop


def serve_timeouts(grace_s: float) -> dict[str, float]:
    """The ingress deployment's graceful-shutdown options for `grace_s`."""
    return {"graceful_shutdown_timeout_s": grace_s + MARGIN_S,
            "graceful_shutdown_wait_loop_s": 1.0}


async def replica_stopping() -> bool:
    """Whether Serve is stopping this replica: its app is being deleted, or a redeploy
    replaced it (the replica's state in Serve's instance details, as the REST API shows it)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    ctx = serve.get_replica_context()
    # a controller call: off the event loop
    details = await asyncio.to_thread(lambda: _get_global_client().get_serve_details())
    app = details.get("applications", {}).get(ctx.app_name)
    if app is None or app.get("status") == "DELETING":
        return True
    dep = app.get("deployments", {}).get(ctx.deployment, {})
    return any(r.get("replica_id") == ctx.replica_tag and r.get("state") in STOPPING
               for r in dep.get("replicas", ()))


class ShutdownWatch:
    """Ends `svc`'s requests `grace_s` after `stopping()` first says the replica is going."""

    def __init__(self, svc: Service, grace_s: float,
                 stopping: Callable[[], Awaitable[bool]] = replica_stopping,
                 poll_s: float = POLL_S) -> None:
        self.svc, self.grace_s, self.stopping, self.poll_s = svc, grace_s, stopping, poll_s
        self.task: asyncio.Task | None = None
        self.stopped = 0  # requests ended past the grace period

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            if not self.svc.live:  # nothing to protect: no controller call
                continue
            try:
                if await self.stopping():
                    break
            except Exception as e:  # the controller busy or going: ask again
                log.debug("reading the app's status failed: %s", e)
        since = time.monotonic()
        log.warning("kvserve: this ingress replica is stopping; %d requests in flight get "
                    "%.0f s to finish", len(self.svc.live), self.grace_s)
        while self.svc.live and time.monotonic() - since < self.grace_s:
            await asyncio.sleep(0.2)
        if self.svc.live:
            self.stopped = self.svc.stop_requests(
                f"kvserve is shutting down: the request did not finish within the "
                f"{self.grace_s:g} s grace period; retry it")
            log.warning("kvserve: ended %d requests past the shutdown grace period", self.stopped)
