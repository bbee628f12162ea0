"""The session's one local Ray + Serve app (two CPU workers), shared by all serving tests."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

# (re-exported for the tests: ports outside the range Ray's start takes ports from)
from kvserve.deploy.serve_stop import free_port  # noqa: F401

T = TypeVar("T")

API_KEY = "test-key"
# small and frugal: 1 torch thread per worker, a small KV pool, a short context
# copies forced for the host tier: the tests count what comes back by copy, whatever the speed
ENGINE = {"num_threads": 1, "kv_cache_tokens": 4096, "max_model_len": 1024, "max_num_seqs": 16,
          "host_restore_policy": "copy"}


def ray_started(start: Callable[[], T], tries: int = 5) -> T:
    """`start()` (a call that starts a local Ray: ray.init, or deploy), run again when Ray's
    own start-up wait (a fixed 30 s for the raylet to register with the GCS) runs out on a
    loaded machine. The processes a failed try started are stopped before the next one."""
    import psutil
    import ray

    me = psutil.Process()
    for attempt in range(tries):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            return start()
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == tries - 1:
                raise
        ray.shutdown()
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=30)
    raise AssertionError("unreachable")


@dataclass
class ServeApp:
    grpc_port: int
    http_port: int
    api_key: str
    router: Any
    config: Any
    metadata: tuple[tuple[str, str], ...] = field(default=())
    metrics_port: int = 0  # Ray's Prometheus endpoint: http://127.0.0.1:<port>/metrics

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def workers(self) -> list[Any]:
        import ray

        return ray.get(self.router.workers.remote())

    def server_info(self) -> dict[str, Any]:
        import ray

        return ray.get(self.router.server_info.remote())

    def ingress_slots(self) -> int | str:
        """Slots the ingress replica holds: requests it is still serving."""
        req = urllib.request.Request(self.http_url + "/v1/server_info",
                                     headers={"authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read()).get("ingress", {}).get("slots", "?")
        except OSError as e:
            return f"unknown ({e})"

    def streams_left(self, settle_s: float) -> int:
        """Streams the workers still run once they all ended or `settle_s` passed."""
        import ray

        deadline = time.monotonic() + settle_s
        while True:
            left = sum(ray.get(w.load.remote())["streams"] for w in self.workers())
            if left == 0 or time.monotonic() > deadline:
                return left
            time.sleep(0.25)

    def cancels_serve_dropped(self, settle_s: float = 10.0) -> int:
        """After clients cancelled every stream they had open: how many still run.

        Serve's gRPC proxy (Ray 2.60) drops a client's cancel that arrives while the proxy
        is writing a message to that client: nothing tells the ingress, and the request runs
        to its end (`length`). Such a stream still holds its ingress slot. One that a worker
        runs after the ingress let it go would be kvserve's own leak, so that fails here.
        Callers give their cancelled streams a `max_tokens` that cannot finish in
        `settle_s` (a worker of the test app makes about 30 tokens/s for one stream on this
        2-core host; a cancel that arrives reaches its worker in well under a second)."""
        left = self.streams_left(settle_s)
        if left:
            held = self.ingress_slots()
            assert held == left, (
                f"{left} stream(s) still run {settle_s:.0f} s after their clients cancelled, "
                f"and the ingress serves {held}: the ingress let a request go that its worker "
                "kept running")
        return left

    @contextlib.contextmanager
    def held(self) -> Iterator[list[Any]]:
        """Every worker's engine paused until the block ends (requests still arrive, moves
        and aborts still run; nothing generates): a test steps a worker by hand
        (`step_engine`) to build the state it checks, instead of racing the engine."""
        import ray

        workers = self.workers()
        ray.get([w.pause_engine.remote() for w in workers])
        try:
            yield workers
        finally:
            for w in workers:
                try:
                    ray.get(w.resume_engine.remote(), timeout=60)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass  # killed by the test (a restarted worker starts unpaused)

    @staticmethod
    def worker_of(workers: list[Any], rid: str | None = None, known: set[str] = frozenset(),
                  timeout: float = 120.0) -> tuple[int, str]:
        """(index, request id) of the worker that holds request `rid` (or, without one,
        the first request not in `known`), once it has arrived there."""
        import ray

        deadline = time.monotonic() + timeout
        while True:
            for i, w in enumerate(workers):
                for r in ray.get(w.unfinished_ids.remote()):
                    if r == rid or (rid is None and r not in known):
                        return i, r
            assert time.monotonic() < deadline, f"request {rid or '(new)'} reached no worker"
            time.sleep(0.05)

    def unfinished(self) -> set[str]:
        import ray

        return {r for w in self.workers() for r in ray.get(w.unfinished_ids.remote())}

    def wait_all_alive(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(w["alive"] for w in self.server_info()["workers"]):
                return
            time.sleep(0.25)
        raise TimeoutError("workers did not all come back")


@pytest.fixture(scope="session")
def serve_app() -> Iterator[ServeApp]:
    from kvserve.deploy.config import ServeConfig
    from kvserve.deploy.serve_cli import deploy
    from kvserve.router.router import NAMESPACE, ROUTER_NAME

    # LoRA on with small slots (tests/deploy/test_serve_lora.py loads adapters at run time)
    cfg = ServeConfig(num_workers=2, num_cpus_per_worker=1, engine=ENGINE, api_keys=[API_KEY],
                      grpc_port=free_port(), http_port=free_port(), max_imbalance=2,
                      enable_lora=True, max_loras=2, max_lora_rank=8)
    # metrics reported every second (Ray's default: 10 s), so tests/deploy/test_metrics.py
    # sees its requests' counts soon
    metrics_port = free_port()
    ray_init = {"num_cpus": 4, "include_dashboard": False, "log_to_driver": False,
                "_metrics_export_port": metrics_port,
                "_system_config": {"metrics_report_interval_ms": 1000}}
    # a loaded 2-core machine can take minutes to bring Serve's proxies up: wait up to 15 min
    ray_started(lambda: deploy(cfg, ray_init=ray_init, start_timeout_s=900))
    import ray

    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    app = ServeApp(cfg.grpc_port, cfg.http_port, API_KEY, router, cfg,
                   metadata=(("authorization", f"Bearer {API_KEY}"),), metrics_port=metrics_port)
    try:
        yield app
    finally:
        from kvserve.router.lifecycle import kill_router

        kill_router()  # detached, so killed explicitly (ray.shutdown below ends the rest)
        ray.shutdown()  # stops Serve with the cluster (a graceful serve.shutdown takes ~20 s)
