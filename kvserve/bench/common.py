"""What every bench shares: random prompts, machine facts, timers, figures, JSON output."""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvserve.hardware import available_cores

# Prompt ids stay this far from both ends of the vocabulary: special and control tokens sit
# at the low end in most vocabularies (SmolLM2: 0..16) and added tokens at the high end.
VOCAB_MARGIN = 100


# ---- workload and machine ------------------------------------------------------------------
def add_async_arg(p: Any) -> None:
    """--async-scheduling for benches that run the engine (EngineConfig.async_scheduling)."""
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="plan step N+1 while step N runs (auto: on for CUDA, off on the CPU)")


def add_restore_policy_arg(p: Any) -> None:
    """--restore-policy for benches with a host tier (EngineConfig.host_restore_policy)."""
    p.add_argument("--restore-policy", choices=["cost", "copy", "recompute"], default="cost",
                   help="host tier: restore parked KV by copy or recompute, whichever the "
                   "measured costs favour (cost), or always one way")


def async_value(choice: str) -> bool | None:
    return {"auto": None, "on": True, "off": False}[choice]


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of exactly `length` ids drawn uniformly, away from special tokens."""
    import torch

    lo = min(VOCAB_MARGIN, vocab_size // 4)
    hi = max(lo + 1, vocab_size - lo)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (num, length), generator=g).tolist()


def machine_info(threads: int) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    ram_gib = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
        ram_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass  # not Linux: keep what platform knows
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": available_cores(),
        "ram_gib": ram_gib,
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


@dataclass
class Timer:
    """Wall and process CPU time of one timed section."""

    t0: float = 0.0
    cpu0: float = 0.0
    elapsed: float = 0.0
    cpu: float = 0.0

    def __enter__(self) -> Timer:
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.cpu0


def figures(
    timer: Timer, prompts: list[list[int]], outputs: list[list[int]], elapsed: float | None = None
) -> dict[str, Any]:
    """The throughput figures every run reports, from what it actually generated; `elapsed`
    replaces the timer's wall time where the run's own timestamps are more exact."""
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o) for o in outputs)
    wall = timer.elapsed if elapsed is None else elapsed
    return {
        "requests": len(prompts),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "elapsed_s": wall,
        "output_tokens_per_s": n_out / wall,
        "total_tokens_per_s": (n_in + n_out) / wall,
        # CPU seconds per wall second: well below the thread count means the run did not get
        # its cores (other load on the machine), and its figures are not representative
        "cpu_per_wall": timer.cpu / timer.elapsed,
    }


def identical(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many sequences agree exactly, and the mean length of the agreeing prefixes."""
    pairs = list(zip(a, b, strict=True))
    # zip stops at the shorter sequence: a length difference is a mismatch past the prefix
    prefix = [
        next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))
        for x, y in pairs
    ]
    return {
        "identical": sum(x == y for x, y in pairs),
        "of": len(pairs),
        "mean_common_prefix": sum(prefix) / max(1, len(prefix)),
    }


def write_json(path: str | None, report: dict[str, Any]) -> None:
    """Write a bench's figures (no-op without a path)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


def progress_bar(enabled: bool, total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, disable=not enabled,
                leave=False, dynamic_ncols=True)
