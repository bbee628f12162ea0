"""The service `kvserve bench serve` starts for itself when it is given no --host.

Workers whose engine has the settings of the bench's in-process engine (device, dtype and
threads included; each worker with its GPU share on a CUDA host), on free local ports, in a
Ray instance this process starts and stops: the gRPC/HTTP run then differs from the engine
run only by the serving path.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class BenchService:
    def __init__(
        self, grpc_port: int, http_port: int, api_key: str | None, config: Any = None
    ) -> None:
        self.ports = {"grpc": grpc_port, "http": http_port}
        self.api_key = api_key
        self.config = config  # the deployed ServeConfig

    def resize(self, num_workers: int) -> None:
        """Serve with `num_workers` workers, as a redeploy that changes only the worker count
        does, without replacing the ingress: the router drains the workers it loses and
        starts those it gains; returns once every serving worker has loaded its model."""
        import ray

        if num_workers == self.config.num_workers:
            return
        t0 = time.perf_counter()
        router = self.router()
        ray.get(router.resize.remote(num_workers))
        ray.get(router.ready.remote(True))  # the added workers too
        self.config = self.config.model_copy(update={"num_workers": num_workers})
        print(f"bench serve: service resized to {num_workers} worker(s) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    def router(self) -> Any:
        """The service's router actor (the same one across resizes)."""
        import ray

        from kvserve.router.router import NAMESPACE

        return ray.get_actor(self.config.router_name, namespace=NAMESPACE)

    def port(self, target: str) -> int:
        return self.ports[target]

    def stop(self) -> None:
        from kvserve.deploy.serve_cli import shutdown

        shutdown()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop the service's processes (SIGSTOP) for the block, then let them go on.

        The Ray processes this bench started are its descendants. Stopped, they use no CPU
        and wake no thread, so the engine rounds of an interleaved comparison run on a
        machine without Ray, as the engine used directly would.
        """
        import psutil

        procs = psutil.Process().children(recursive=True)
        stopped = []
        try:
            for p in procs:
                try:
                    p.send_signal(signal.SIGSTOP)
                    stopped.append(p)
                except psutil.Error:  # exited meanwhile
                    pass
            _wait_stopped(stopped)
            yield
        finally:
            for p in stopped:
                try:
                    p.send_signal(signal.SIGCONT)
                except psutil.Error:
                    pass


def _wait_stopped(procs: list[Any], timeout_s: float = 2.0) -> None:
    """SIGSTOP takes effect when a process next leaves the kernel; one in an uninterruptible
    wait (disk I/O) runs on until then. Wait, bounded, so the block starts on a quiet machine."""
    import psutil

    deadline = time.monotonic() + timeout_s
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                    break
            except psutil.Error:  # exited
                break
            time.sleep(0.005)


def start_service(
    engine: Any, api_key: str | None = None, stream_interval_ms: float | None = None,
    num_workers: int = 1, pin_sessions: bool = False, num_gpus_per_worker: float = 0.0,
    **serve_settings: Any,
) -> BenchService:
    """Deploy the app with `num_workers` workers running `engine` (an EngineConfig), each
    with `num_gpus_per_worker` of a GPU; wait until ready. `pin_sessions`: a session stays on
    its worker however loaded (--skew)."""
    import ray

    from kvserve.deploy.config import ServeConfig
    from kvserve.deploy.serve_cli import deploy, shutdown
    from kvserve.deploy.serve_stop import free_port  # outside the ports Ray's start takes

    if ray.is_initialized():
        raise RuntimeError("bench serve starts its own Ray; pass --host to use a running service")
    settings = engine.model_dump(exclude={"model"}, exclude_defaults=True)
    cfg = ServeConfig(model=engine.model, engine=settings,
                      grpc_port=free_port(), http_port=free_port(),
                      api_keys=[api_key] if api_key else [],
                      stream_interval_ms=stream_interval_ms, num_workers=num_workers,
                      num_gpus_per_worker=num_gpus_per_worker,
                      max_imbalance=1_000_000 if pin_sessions else 4, **serve_settings)
    each = (f"{num_gpus_per_worker:g} GPU" if num_gpus_per_worker
            else f"{engine.num_threads} threads")
    workers = (f"{cfg.prefill_workers} prefill + {cfg.decode_workers} decode worker(s)"
               if cfg.disaggregated else f"{num_workers} worker(s)")
    print(f"bench serve: starting the service ({workers} on {engine.device}, "
          f"{engine.dtype}, {each} each) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    # the workers' logs stay in Ray's log files: the bench prints only its own figures
    try:
        deploy(cfg, ray_init={"log_to_driver": False, "include_dashboard": False})
    except BaseException:  # Ctrl-C or a failed deploy: do not leave Ray running
        shutdown()
        raise
    print(f"bench serve: service up in {time.perf_counter() - t0:.1f} s "
          f"(gRPC :{cfg.grpc_port}, HTTP :{cfg.http_port})", file=sys.stderr, flush=True)
    return BenchService(cfg.grpc_port, cfg.http_port, api_key, cfg)
