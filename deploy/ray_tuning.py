"""Quieter Ray housekeeping for a Ray that kvserve starts itself on a CPU host.

On a small CPU host the engine's OpenMP threads hold every core, and each wake-up of
another process stalls a step (its threads meet at barriers). Idle, a local Ray + Serve
stack wakes ~1,900 times a second; most of it is periodic bookkeeping whose default
period suits large clusters. These settings stretch the periods that only feed
dashboards and slow control loops (docs/benchmarks.md: +1.5-4.5% tokens/s against the engine
on 2 cores, compared in interleaved rounds). They are defaults: a variable already in
the environment wins, and a Ray cluster that kvserve joins keeps its own settings.
"""

from __future__ import annotations

import os

CPU_HOST_RAY_ENV = {
    # Serve: controller loop 0.1 -> 0.5 s; metrics pushed every 1 s, not 0.1 s
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    # Ray core: raylet resource reports and GC checks 0.1 -> 1 s, memory monitor
    # 0.25 -> 1 s, task-event reports 1 -> 5 s, no per-handler event statistics
    "RAY_raylet_report_resources_period_milliseconds": "1000",
    "RAY_raylet_check_gc_period_milliseconds": "1000",
    "RAY_memory_monitor_refresh_ms": "1000",
    "RAY_task_events_report_interval_ms": "5000",
    "RAY_event_stats": "0",
}


def apply_cpu_host_defaults() -> dict[str, str]:
    """Set the settings not already set, before Ray starts (its processes inherit them);
    returns the ones applied."""
    applied = {k: v for k, v in CPU_HOST_RAY_ENV.items() if k not in os.environ}
    os.environ.update(applied)
    return applied
