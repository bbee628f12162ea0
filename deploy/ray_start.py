"""Starting a local Ray on a loaded machine: a start that timed out is tried again.

Ray's raylet gives the dashboard agent it starts about 15 s to report its ports, and the
driver gives the dashboard 60 s to come up (Ray 2.60; the first wait is not configurable).
On a 2-core machine busy with other work, a cold import of the agent takes longer, the
raylet aborts, and `ray.init` fails with "The current node timed out during startup" (or
"Failed to start the dashboard"). The second start finds the imports in the page cache.
What the failed start left running (GCS, dashboard, ...) is ended before the next one.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

TRIES = 3
# what ray.init says when its own processes were too slow to start
START_TIMEOUTS = ("timed out during startup", "Failed to start the dashboard",
                  "contains the error message from the dashboard")


def init_ray(args: dict[str, Any], tries: int = TRIES) -> None:
    """ray.init(**args), tried again (up to `tries` in all) when Ray's start timed out."""
    import ray

    for attempt in range(1, tries + 1):
        before = {p.pid for p in _descendants()}
        try:
            ray.init(**args)
            return
        except Exception as e:
            if attempt == tries or not any(m in str(e) for m in START_TIMEOUTS):
                raise
            log.warning("kvserve: Ray's start timed out on this busy machine (%s); starting it "
                        "again (%d of %d)", str(e).splitlines()[0][:200], attempt + 1, tries)
            _end_new(before)


def _descendants() -> list[Any]:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _end_new(before: set[int]) -> None:
    """End the processes the failed start left (descendants that were not there before)."""
    import psutil
    import ray

    try:
        ray.shutdown()  # whatever part of the driver's state the failed start set up
    except Exception as e:
        log.debug("ray.shutdown after a failed start: %s", e)
    new = [p for p in _descendants() if p.pid not in before]
    for p in new:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(new, timeout=10)
