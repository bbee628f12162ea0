"""Whether a `kvserve bench serve` run had the machine to itself.

On a shared machine the serving figures swing by 2x and more with other load. The meter
takes the machine's busy CPU time over a run and subtracts what this process and its
descendants used (the in-process engine, or the Ray processes of a self-started service);
the rest is other load. A service given by --host is not a descendant: its CPU counts as
other load, so the check is only meaningful for in-process and self-started runs.
"""

from __future__ import annotations

import os
import time
from typing import Any

OTHER_LOAD_WARN_CORES = 0.25


def _tree_cpu() -> dict[int, float]:
    import psutil

    me = psutil.Process()
    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:  # exited meanwhile
            pass
    return out


def _machine_busy() -> float:
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class CpuMeter:
    """`with CpuMeter() as m: ...`, then `m.figures`; empty figures without psutil."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}

    def __enter__(self) -> CpuMeter:
        try:
            self._tree0, self._busy0 = _tree_cpu(), _machine_busy()
        except ImportError:
            self._tree0 = None
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        if self._tree0 is None or wall <= 0:
            return
        busy = _machine_busy() - self._busy0
        tree1 = _tree_cpu()
        own = sum(t - self._tree0.get(pid, 0.0) for pid, t in tree1.items())
        self.figures = {
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "wall_s": wall,
            "bench_cores": own / wall,  # this process and its children (service included)
            "other_cores": max(0.0, busy - own) / wall,
        }

    @classmethod
    def merged(cls, parts: list[CpuMeter]) -> CpuMeter:
        """One meter for a run measured in slices: CPU summed over the slices' wall time."""
        m = cls()
        figs = [p.figures for p in parts if p.figures]
        wall = sum(f["wall_s"] for f in figs)
        if figs and wall > 0:
            m.figures = {
                "cores": figs[0]["cores"],
                "wall_s": wall,
                **{k: sum(f[k] * f["wall_s"] for f in figs) / wall
                   for k in ("bench_cores", "other_cores")},
            }
        return m

    def warning(self, name: str) -> str | None:
        other = self.figures.get("other_cores")
        if other is None or other < OTHER_LOAD_WARN_CORES:
            return None
        return (f"warning: other processes used {other:.2f} cores on average during the {name} "
                "run; its figures are not representative (re-run on a quiet machine)")
