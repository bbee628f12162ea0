"""Before deploying: can the cluster's nodes ever hold the workers?

Each worker reserves one bundle on one node (`workers/placement.py`), so what counts is how
many bundles each node holds, never the cluster's sum: two nodes of 2 GPUs do not hold a
worker of 4. On a Ray that cannot add nodes (a local Ray, a cluster without an autoscaler)
a worker beyond that count would wait for good, so the deployment fails at once, before any
model loads, naming the numbers and the ways out. Where an autoscaler may add nodes, such
workers wait for one (the router shows them as "waiting for resources", router/placement.py).

The comparison is with the nodes' totals, not what is free now: resources that others hold
may be released, and a kvserve router that is reused keeps its workers' reservations.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.deploy.config import ServeConfig
from kvserve.errors import StartupError
from kvserve.workers.placement import format_resources, worker_bundle

log = logging.getLogger(__name__)

EPS = 1e-6  # Ray keeps resources in units of 1e-4: this only absorbs float rounding
# the node types Ray's read-only autoscaler (no node provider: nothing to launch) reports
READONLY_NODE_TYPE = re.compile(r"node_[0-9a-f]+")
AUTOSCALING_STATUS_KEY = "__autoscaling_status"  # ray_constants.DEBUG_AUTOSCALING_STATUS
MAX_NODES_NAMED = 6


class PlacementError(StartupError):
    """The workers can never all be placed on this cluster's nodes."""


@dataclass(frozen=True)
class Node:
    name: str  # its address, for messages
    resources: Mapping[str, float]  # its totals


@dataclass(frozen=True)
class Demand:
    num_workers: int
    bundle: Mapping[str, float]  # what one worker reserves on one node
    tensor_parallel_size: int = 1
    # "prefill", "decode" (the workers of one role: their flags are named), "both" (all
    # workers of a deployment with roles, whose roles reserve the same bundle)
    role: str = ""
    count_flag: str = "--workers"  # the setting that asks for that many mixed workers


def demand_of(cfg: ServeConfig) -> Demand:
    """The most workers the app may run at once (an autoscaled pool: max_workers)."""
    flag = "--max-workers" if cfg.autoscaling and cfg.autoscaling.max_workers >= cfg.num_workers \
        else "--workers"
    return Demand(cfg.most_workers(),
                  worker_bundle(cfg.num_cpus_per_worker, cfg.num_gpus_per_worker),
                  cfg.tensor_parallel_size, count_flag=flag)


def demands_of(cfg: ServeConfig) -> list[Demand]:
    """What the workers need: one demand, or with prefill and decode workers one per role
    and (where both roles reserve the same bundle) all of them together. Each is a
    condition the nodes must meet; roles with different bundles are not packed jointly, so
    a deployment that passes may still leave a worker waiting."""
    if not cfg.disaggregated:
        return [demand_of(cfg)]
    per_role = [Demand(n, worker_bundle(cfg.num_cpus_per_worker, cfg.role_gpus(role)),
                       cfg.role_tensor_parallel_size(role), role)
                for role, n in (("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers))]
    a, b = per_role
    if dict(a.bundle) == dict(b.bundle):
        both = Demand(a.num_workers + b.num_workers, a.bundle,
                      max(a.tensor_parallel_size, b.tensor_parallel_size), "both")
        return [*per_role, both]
    return per_role


def fit_count(bundle: Mapping[str, float], resources: Mapping[str, float]) -> float:
    """How many such bundles one node holds at once (inf for an empty bundle)."""
    need = {k: v for k, v in bundle.items() if v > 0}
    if not need:
        return math.inf
    return min(math.floor(resources.get(k, 0.0) / v + EPS) for k, v in need.items())


def held_at_once(bundle: Mapping[str, float], nodes: Sequence[Node], limit: int) -> int:
    """Workers the nodes hold together (each whole on one node), up to `limit`."""
    return int(min(limit, sum(min(limit, fit_count(bundle, n.resources)) for n in nodes)))


def unplaceable(demand: Demand, nodes: Sequence[Node]) -> str | None:
    """None when the nodes hold every worker at once; else why not, with the ways out."""
    n, bundle = demand.num_workers, dict(demand.bundle)
    held = held_at_once(bundle, nodes, n)
    if held >= n:
        return None
    tp = demand.tensor_parallel_size
    one = format_resources(bundle) + (
        f" on one node (its {tp} tensor-parallel ranks' devices together)" if tp > 1 else "")
    kind = {"": "worker", "both": "prefill and decode worker"}.get(demand.role,
                                                                  f"{demand.role} worker")
    if held == 0:
        why = f"no node can hold one {kind}, which needs {one}"
    else:
        why = f"{n} {kind}s need {one} each, and the nodes hold {held} at once"
    return (f"{why}; the nodes have {_nodes_text(bundle, nodes)}. Ways out: "
            + "; ".join(_ways_out(demand, nodes, held)))


def _nodes_text(bundle: Mapping[str, float], nodes: Sequence[Node]) -> str:
    def amounts(res: Mapping[str, float]) -> str:
        return format_resources({k: res.get(k, 0.0) for k in bundle})

    shown = [f"{n.name} {amounts(n.resources)}" for n in nodes[:MAX_NODES_NAMED]]
    if len(nodes) > MAX_NODES_NAMED:
        shown.append(f"and {len(nodes) - MAX_NODES_NAMED} more")
    return ", ".join(shown) if shown else "none"


def _ways_out(demand: Demand, nodes: Sequence[Node], held: int) -> list[str]:
    bundle, n, tp = dict(demand.bundle), demand.num_workers, demand.tensor_parallel_size
    role = f"{demand.role}-" if demand.role in ("prefill", "decode") else ""
    ways = []
    if held > 0:
        ways.append(f"fewer --prefill-workers and --decode-workers ({held} in all)"
                    if demand.role == "both" else f"--{role}workers {held}" if role
                    else f"{demand.count_flag} {held}")
    for key, flag in (("CPU", "--cpus-per-worker"), ("GPU", f"--{role}gpus-per-worker")):
        if key not in bundle or (key == "GPU" and tp > 1):
            continue
        share = _largest_share(bundle, key, nodes, n)
        if share is not None:
            shared = " (workers share a GPU)" if key == "GPU" and share < 1 else ""
            ways.append(f"{flag} {share:g}{shared}")
        elif key == "GPU" and not any(nd.resources.get("GPU", 0) > 0 for nd in nodes):
            ways.append(f"{flag} 0 (CPU workers: no node has a GPU)")
    if tp > 1 and "GPU" in bundle:  # (on CPU workers the size does not change the bundle)
        most = max((nd.resources.get("GPU", 0.0) for nd in nodes), default=0.0)
        ways.append(f"a smaller --{role}tensor-parallel-size (the most GPUs on one node: "
                    f"{most:g})")
    ways.append("more or larger nodes (a larger Ray, or a cluster with an autoscaler)")
    return ways


def _largest_share(bundle: dict[str, float], key: str, nodes: Sequence[Node],
                   n: int) -> float | None:
    """The largest amount of `key` per worker (two decimals, rounded down) with which the
    nodes hold all `n` workers, the bundle's other amounts kept; None if none does."""
    best = None
    for node in nodes:
        have = node.resources.get(key, 0.0)
        for k in range(1, n + 1):
            share = math.floor(have / k * 100 + EPS) / 100
            if share <= 0 or share >= bundle[key] or (best is not None and share <= best):
                continue
            if held_at_once({**bundle, key: share}, nodes, n) >= n:
                best = share
    return best


# ---- the cluster ----------------------------------------------------------------------------
def cluster_nodes() -> list[Node]:
    """The alive nodes of the connected Ray, with their total resources."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    addrs = [n.get("NodeManagerAddress", "?") for n in alive]
    return [Node(a if addrs.count(a) == 1 else f"{a} ({n['NodeID'][:8]})", dict(n["Resources"]))
            for a, n in zip(addrs, alive, strict=True)]


def autoscaler_can_add_nodes(status: Mapping[str, Any] | None, v2: bool) -> bool | None:
    """Whether the cluster's autoscaler may add nodes, from what it reports; None when it
    has not reported yet.

    Ray's monitor runs on every head. Given no node provider (a local Ray, `ray start`
    clusters, KubeRay without autoscaling) it is read-only, and names each node type after
    the node itself (`node_<id>`); a real autoscaler (KubeRay's, a cloud launcher's) reports
    the node types of its configuration. Autoscaler v2 runs only where one is configured."""
    if v2:
        return True
    report = (status or {}).get("autoscaler_report")
    if not report:
        return None
    types = set((report.get("node_type_mapping") or {}).values())
    types |= set(report.get("active_nodes") or {}) | set(report.get("pending_launches") or {})
    if not types:
        return None
    return not all(READONLY_NODE_TYPE.fullmatch(t) for t in types)


def can_add_nodes() -> bool | None:
    """Whether the connected Ray's autoscaler may add nodes (None: cannot tell yet)."""
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        v2 = is_autoscaler_v2(fetch_from_server=True)
    except Exception:
        v2 = False
    raw = _internal_kv_get(AUTOSCALING_STATUS_KEY)
    try:
        status = json.loads(raw) if raw else None
    except ValueError:
        status = None
    return autoscaler_can_add_nodes(status, v2)


def check_placement(cfg: ServeConfig, own_ray: bool = False) -> None:
    """Raise PlacementError when the workers can never all be placed: they do not fit the
    nodes, and the cluster cannot add any (`own_ray`: a Ray kvserve started, which cannot).
    Where it may add nodes, or cannot tell, the workers that do not fit wait for a node
    (logged here; the router shows them)."""
    nodes = cluster_nodes()
    why = next((w for w in (unplaceable(d, nodes) for d in demands_of(cfg)) if w), None)
    if why is None:
        return
    scalable = False if own_ray else can_add_nodes()
    if scalable is False:
        raise PlacementError(f"the workers cannot be placed, and this Ray cannot add nodes: {why}")
    log.warning("kvserve: %s; %s", why, "waiting for the autoscaler to add nodes" if scalable
                else "waiting for nodes to join (this Ray's autoscaler has not reported yet)")
