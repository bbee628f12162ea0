"""What this process may run on (shared by the engine's defaults, the router and the benches)."""

from __future__ import annotations

import os


def available_cores() -> int:
    # the affinity mask, not os.cpu_count(): containers and taskset limit the usable cores
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
