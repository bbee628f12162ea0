"""RouterConfig: what the router needs to start its workers and route (built by deploy)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RouterConfig:
    num_workers: int = 1
    engine: dict[str, Any] = field(default_factory=dict)  # an EngineConfig as a dict
    num_cpus_per_worker: float = 1
    num_gpus_per_worker: float = 0
    stream_interval_ms: float | None = None
    routing_policy: str = "affinity"
    max_imbalance: int = 4
    max_inflight_per_worker: int = 256
    load_poll_interval_s: float = 1.0
    model_name: str = ""  # the served name (metrics tag); "" = the model file's stem
    # a slot the worker has not known for this long is dropped as stale (a lost release)
    slot_grace_s: float = 60.0
    # a worker Ray has not placed this long after its start is stopped and reported failed
    placement_timeout_s: float = 900.0
    migration: dict[str, Any] = field(default_factory=dict)  # a MigrationConfig as a dict
    # an AutoscalingConfig as a dict ({}: off, a fixed pool of num_workers)
    autoscaling: dict[str, Any] = field(default_factory=dict)
    # per worker index: EngineConfig fields that differ from `engine` (e.g. a smaller pool)
    engine_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    # disaggregated serving: each worker's role (mixed, prefill, decode; empty: all mixed),
    # EngineConfig fields and GPUs per role where they differ (tensor_parallel_size...), and
    # the DisaggConfig (router/disagg.py) as a dict
    roles: list[str] = field(default_factory=list)
    role_engine: dict[str, dict[str, Any]] = field(default_factory=dict)
    role_gpus: dict[str, float] = field(default_factory=dict)
    disagg: dict[str, Any] = field(default_factory=dict)
    # workers of every base model of the service (several models: their routers' workers
    # share the node's CPU cores); 0 = this router's own
    cpu_share_workers: int = 0

    def role_of(self, idx: int) -> str:
        return self.roles[idx] if idx < len(self.roles) else "mixed"

    def gpus_of(self, idx: int) -> float:
        return float(self.role_gpus.get(self.role_of(idx), self.num_gpus_per_worker))

    def worker_engine(self, node_cores: int) -> dict[str, Any]:
        """A worker's EngineConfig; on CPU, unset torch threads share the node's cores."""
        engine = dict(self.engine)
        if engine.get("device", "auto") == "auto":
            # a worker with a GPU share runs on it (Ray sets CUDA_VISIBLE_DEVICES per actor);
            # one without runs on the CPU even on a CUDA host, rather than on a GPU it was
            # not given
            engine["device"] = "cuda" if self.num_gpus_per_worker > 0 else "cpu"
        # Left alone, a Ray actor runs torch with OMP_NUM_THREADS = its num_cpus (1); an
        # autoscaled pool shares the cores as its largest size would
        if engine.get("num_threads") is None and self.num_gpus_per_worker == 0:
            most = max(self.num_workers, int(self.autoscaling.get("max_workers", 0)),
                       self.cpu_share_workers)
            engine["num_threads"] = max(1, node_cores // most)
        return engine

    def engine_of(self, idx: int, engine: dict[str, Any]) -> dict[str, Any]:
        out = {**engine, **self.role_engine.get(self.role_of(idx), {}),
               **self.engine_overrides.get(idx, {})}
        if (self.engine.get("device", "auto") == "auto"
                and self.gpus_of(idx) != self.num_gpus_per_worker):
            out["device"] = "cuda" if self.gpus_of(idx) > 0 else "cpu"  # (its role's GPUs)
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        """Names this configuration: a deployment with another one needs another router,
        unless only `num_workers` differs (see `shape_digest`)."""
        return _digest(self.to_dict())

    def shape_digest(self) -> str:
        """Names this configuration but for its worker count and autoscaling settings: a
        router whose shape matches a deployment's is resized to it (drains the workers it
        loses, starts the ones it gains) or given its new bounds, rather than replaced."""
        return _digest({k: v for k, v in self.to_dict().items()
                        if k not in ("num_workers", "autoscaling")})


def _digest(d: dict[str, Any]) -> str:
    text = json.dumps(d, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
