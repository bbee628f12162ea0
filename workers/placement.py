"""What one worker reserves on its node, and how kvserve writes resources in its messages.

A worker is one Ray bundle on one node: its CPUs and GPUs. A tensor-parallel worker's bundle
holds every rank's GPU (its placement group, STRICT_PACK); a plain worker's actor asks for
the same amounts. Ray never splits a bundle over nodes, so a worker fits a node or none.
(No Ray import here: the CLI's placement check and the router's watch both use it.)
"""

from __future__ import annotations

from collections.abc import Mapping


def worker_bundle(num_cpus: float, num_gpus: float) -> dict[str, float]:
    """The resources one worker reserves on one node (zero amounts left out, as Ray does)."""
    return {k: float(v) for k, v in (("CPU", num_cpus), ("GPU", num_gpus)) if v > 0}


def format_resources(resources: Mapping[str, float]) -> str:
    """`{CPU: 1, GPU: 0.5}`: the amounts as an operator writes them."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"
