"""Workers Ray cannot place, on a real Ray: a local Ray that can never hold them fails before
any model loads (`kvserve serve` itself, and the check on the session's Ray: 4 CPUs)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from serve_process import ServeProcess

from kvserve.deploy.config import ServeConfig

WAIT_S = 300.0  # bound on every wait for an observed event (a loaded machine is slow)


def _until(what: str, check: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.2)
    return got


@pytest.mark.slow  # a Ray of its own: 10-40 s on the 2-core host
def test_serve_on_a_two_cpu_ray_refuses_three_one_cpu_workers_before_loading():
    """`kvserve serve --workers 3` (one CPU each) on a local Ray of 2 CPUs: it stops at once,
    before the model loads, naming the numbers and the ways out, and leaves nothing."""
    sp = ServeProcess(workers=3, env={"RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 2})})
    try:
        sp.signalled_at = time.monotonic()  # (no signal: the deadline counts from here)
        rc = sp.wait_exit(WAIT_S)
    finally:
        sp.kill()
    out = "\n".join(sp.lines)
    assert rc == 2, sp.output
    assert ("kvserve: error: the workers cannot be placed, and this Ray cannot add nodes: 3 workers "
            "need {CPU: 1} each, and the nodes hold 2 at once; the nodes have 127.0.0.1 "
            "{CPU: 2}. Ways out: --workers 2; --cpus-per-worker 0.66; more or larger nodes"
            in out), sp.output
    assert "deploying" not in out and "loading" not in out, sp.output  # no model loaded
    assert not sp.left_running(), sp.left_running()


def test_the_check_on_a_running_local_ray(serve_app):
    from kvserve.deploy.placement import PlacementError, can_add_nodes, check_placement

    # a local Ray's monitor is read-only (it reports within seconds of the start)
    assert _until("the autoscaler's report", lambda: can_add_nodes() is not None, 60) is True
    assert can_add_nodes() is False
    with pytest.raises(PlacementError, match=r"cannot add nodes: 5 workers need \{CPU: 1\} each, "
                       r"and the nodes hold 4 at once; .* Ways out: --workers 4; "
                       r"--cpus-per-worker 0\.8; "):
        check_placement(ServeConfig(num_workers=5))
    # totals that hold them pass, even with the app's workers holding some of them now
    check_placement(ServeConfig(num_workers=4))
    with pytest.raises(PlacementError, match=r"no node can hold one worker, which needs "
                       r"\{CPU: 1, GPU: 1\}.*--gpus-per-worker 0 \(CPU workers"):
        check_placement(ServeConfig(num_workers=1, num_gpus_per_worker=1))
