"""Where `kvserve bench serve` runs its engines: the in-process engine and the self-started
service's workers on the same device and dtype, with each worker's GPU share and threads.

On a CUDA host the device resolves to `cuda` and each worker gets a GPU share (a worker
without one sees no GPU: Ray hides the others through CUDA_VISIBLE_DEVICES); torch thread
counts are left alone there (the engine sets them on CPU only). On CPU the in-process engine
gets all cores and each of N workers cores/N, as `kvserve serve` gives them.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Placement:
    device: str  # "cpu" or "cuda"
    dtype: str  # resolved: float32 / float16 / bfloat16
    gpus_per_worker: float  # Ray num_gpus of each service worker; 0 on CPU


def default_gpu_share(num_workers: int, gpus: int) -> float:
    """One GPU per worker while there are enough; else the workers share them evenly."""
    if gpus >= num_workers:
        return 1.0
    return 1.0 / math.ceil(num_workers / gpus)


def resolve(a: argparse.Namespace, cuda_gpus: int) -> Placement | str:
    """The run's placement, or the first problem with the arguments as one line.
    `cuda_gpus`: the GPUs torch sees (0 without CUDA)."""
    device = a.device if a.device != "auto" else ("cuda" if cuda_gpus else "cpu")
    if device == "cuda" and not cuda_gpus:
        return "--device cuda: torch sees no CUDA GPU on this host"
    g = a.gpus_per_worker
    if g is not None and not 0 <= g <= 1:
        return f"--gpus-per-worker must be in [0, 1] (one engine uses one GPU), got {g}"
    if device == "cpu" and g:
        why = "--device cpu" if a.device == "cpu" else "torch sees no CUDA GPU on this host"
        return f"--gpus-per-worker {g:g} puts the workers on a GPU, but the device is cpu ({why})"
    if device == "cuda" and g == 0:
        return "--device cuda needs --gpus-per-worker > 0: a worker without a GPU share sees no GPU"
    if device == "cuda" and a.threads is not None:
        return "--threads sets CPU torch threads; the engines run on cuda"
    if g is None:
        g = default_gpu_share(a.workers, cuda_gpus) if device == "cuda" else 0.0
    dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return Placement(device, dtype, g)


def _engine(a: argparse.Namespace, p: Placement, threads: int | None, kv: int | None) -> Any:
    from kvserve.config import EngineConfig

    kw = {"model": a.model, "kv_cache_tokens": kv, "max_num_seqs": a.max_num_seqs,
          # auto stays auto: the engine's own choice of the KV cache's dtype follows it
          "device": p.device, "dtype": p.dtype if a.dtype != "auto" else None,
          "num_threads": threads, "cpu_matmul": getattr(a, "cpu_matmul", None),
          "kv_cache_dtype": getattr(a, "kv_cache_dtype", None),
          "async_scheduling": {"on": True, "off": False}.get(getattr(a, "async_scheduling", "auto"))}
    return EngineConfig(**{k: v for k, v in kw.items() if v is not None})


def engine_config(a: argparse.Namespace, p: Placement) -> Any:
    """The in-process engine: all cores on CPU (set explicitly, as for the workers)."""
    from kvserve.hardware import available_cores

    threads = (a.threads or available_cores()) if p.device == "cpu" else None
    return _engine(a, p, threads, a.kv_cache_tokens)


def worker_kv_tokens(a: argparse.Namespace) -> int | None:
    """--compare-workers: each of the N workers gets 1/N of --kv-cache-tokens (the engine's
    default pool when not given), in both configurations."""
    if not a.compare_workers:
        return a.kv_cache_tokens
    from kvserve.config import EngineConfig

    total = a.kv_cache_tokens or EngineConfig.model_fields["kv_cache_tokens"].default
    return total // a.workers


def service_engine(a: argparse.Namespace, p: Placement) -> Any:
    """Each worker of the self-started service: on CPU the cores split over the workers
    (explicit, so that a Ray actor does not run torch on OMP_NUM_THREADS = num_cpus)."""
    from kvserve.hardware import available_cores

    threads = None
    if p.device == "cpu":
        threads = a.threads or max(1, available_cores() // a.workers)
    return _engine(a, p, threads, worker_kv_tokens(a))
