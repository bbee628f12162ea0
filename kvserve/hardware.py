"""What this process may run on (shared by the engine's defaults, the router and the benches)."""

from __future__ import annotations

import math
import os

CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_QUOTA = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"
CGROUP_V1_PERIOD = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"


def available_cores() -> int:
    """Cores this process may use: the affinity mask (containers, taskset), capped by a cgroup
    CPU quota (a Kubernetes CPU limit leaves the mask at the whole node)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    return max(1, min(cores, math.floor(quota))) if quota else cores


def cgroup_cpu_limit(v2: str = CGROUP_V2_CPU_MAX, v1_quota: str = CGROUP_V1_QUOTA,
                     v1_period: str = CGROUP_V1_PERIOD) -> float | None:
    """The CPU quota in cores (cgroup v2 `cpu.max`, else v1 CFS quota), None when unlimited."""
    try:
        with open(v2) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(v1_quota) as f, open(v1_period) as g:
            quota_us, period_us = int(f.read()), int(g.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
