"""kvserve's Grafana dashboard where Ray provisions its own.

Ray's dashboard writes its Grafana dashboards (Core, Serve, Serve LLM, Data, Train) into the
head node's session folder `metrics/grafana/dashboards/` ($RAY_METRICS_GRAFANA_DASHBOARD_
OUTPUT_DIR if set), from which its documented local Grafana set-up provisions them. The
ingress adds kvserve's dashboard there when it starts. It is the file the Helm chart installs
as a ConfigMap (helm/kvserve/dashboards/kvserve.json, shipped in the package as
`kvserve.dashboards`), so both show the same dashboard.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SOURCE = "kvserve.json"
FILE_NAME = "kvserve_grafana_dashboard.json"  # beside Ray's <name>_grafana_dashboard.json
RAY_OWN = "default_grafana_dashboard.json"  # written by Ray each time it (re)makes the folder
OUTPUT_DIR_ENV = "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"
HEAD_RESOURCE = "node:__internal_head__"
WAIT_S = 300.0  # how long to wait for Ray's dashboard to make its folder (then: no dashboard)


def dashboard_json() -> bytes:
    """The dashboard's JSON: the chart's file, as an installed package ships it
    (kvserve/dashboards/), or from the checkout's chart (an editable install)."""
    shipped = resources.files("kvserve").joinpath("dashboards").joinpath(SOURCE)
    if shipped.is_file():
        return shipped.read_bytes()
    return (Path(__file__).resolve().parents[1] / "helm" / "kvserve" / "dashboards"
            / SOURCE).read_bytes()


def dashboards_dir(session_dir: str) -> Path:
    """Where Ray's dashboard writes its Grafana dashboards for this session."""
    out = os.environ.get(OUTPUT_DIR_ENV)
    return Path(out) if out else Path(session_dir) / "metrics" / "grafana" / "dashboards"


def write_dashboard(folder: Path) -> Path:
    """Write kvserve's dashboard into `folder` (atomically: Grafana may be reading it)."""
    path = folder / FILE_NAME
    tmp = folder / f".{FILE_NAME}.{os.getpid()}"
    tmp.write_bytes(dashboard_json())
    os.replace(tmp, path)
    return path


def provision(wait_s: float = WAIT_S) -> str | None:
    """On the head node: once Ray's dashboard has written its own dashboards (it empties the
    folder when it starts), add kvserve's. Returns the path written, None when this Ray runs
    no dashboard."""
    from ray._private import worker

    folder = dashboards_dir(worker._global_node.get_session_dir_path())
    deadline = time.monotonic() + wait_s
    while not (folder / RAY_OWN).exists():
        if time.monotonic() > deadline:
            log.info("kvserve: no Ray dashboard wrote %s; kvserve's Grafana dashboard is not "
                     "provisioned there", folder)
            return None
        time.sleep(1.0)
    path = write_dashboard(folder)
    log.info("kvserve: wrote its Grafana dashboard to %s", path)
    return str(path)


def start_provisioning() -> Any:
    """Provision in the background, never failing the caller: in a thread when this process
    runs on the head node (one machine: `kvserve serve`), else in a task placed there."""
    import ray

    def run() -> None:
        try:
            if _on_head_node():
                provision()
            else:
                ray.remote(provision).options(num_cpus=0, resources={HEAD_RESOURCE: 0.001},
                                              max_retries=0).remote()
        except Exception as e:  # a dashboard is a convenience: serving goes on without it
            log.warning("kvserve: provisioning its Grafana dashboard failed: %s", e)

    t = threading.Thread(target=run, name="grafana-dashboard", daemon=True)
    t.start()
    return t


def _on_head_node() -> bool:
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return any(n.get("NodeID") == node_id and HEAD_RESOURCE in n.get("Resources", {})
               for n in ray.nodes())
