"""`kvserve serve`'s start-up lines: each worker's state as it changes, read from the router.

While the app deploys: downloading the model with its bytes, loading, capturing graphs,
waiting for resources (no node has room for the worker yet). The app may serve before every
worker is ready (workers that wait for a node the autoscaler adds); the lines then go on
for those, "ready" included, until each is ready or has failed.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class StartupStates:
    PERIOD_S = 2.0

    def __init__(self, router_name: str | list[tuple[str, str]]) -> None:
        # one router, or (model, router) pairs: several base models, their workers named
        # "model/worker-i"
        self.routers = [("", router_name)] if isinstance(router_name, str) else router_name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="startup-states", daemon=True)
        self._shown: dict[str, str] = {}
        self._serving = False  # the app serves: "ready" is news too

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def failed(self) -> str | None:
        """'worker-i: failed: why' of a worker whose start-up failed, if any (asks once more)."""
        try:
            self.poll(quiet=True)
        except Exception:
            pass
        return next((f"{w}: {s}" for w, s in self._shown.items() if s.startswith("failed: ")),
                    None)

    def not_ready(self) -> dict[str, str]:
        """The workers not ready when last read, with their states."""
        return {w: s for w, s in self._shown.items() if s != "ready"}

    def keep_showing(self) -> None:
        """The app serves: go on showing the workers not ready yet, until each is ready or
        has failed (`stop` ends it sooner)."""
        if not self._pending():
            return
        self._serving = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="startup-states", daemon=True)
        self._thread.start()

    def _pending(self) -> bool:
        return any(not s.startswith("failed: ") for s in self.not_ready().values())

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            try:
                self.poll()
            except Exception as e:  # not up yet, or restarting: the next poll tries again
                log.debug("reading the workers' start-up states failed: %s", e)
            if self._serving and not self._pending():
                return

    def poll(self, quiet: bool = False) -> None:
        import ray

        from kvserve.router.lifecycle import find_router

        if not ray.is_initialized():
            return
        for model, name in self.routers:
            router = find_router(name)
            if router is None:
                continue
            for w in ray.get(router.server_info.remote(), timeout=10)["workers"]:
                state, wid = w["state"], f"{model}/{w['worker_id']}" if model else w["worker_id"]
                new = self._shown.get(wid) != state
                if new and (state != "ready" or self._serving) and not quiet:
                    print(f"kvserve: {wid}: {state}", flush=True)
                self._shown[wid] = state
