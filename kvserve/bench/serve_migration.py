"""`kvserve bench serve --compare-migration`: the same skewed load with stream migration on,
then off, against one self-started multi-worker service.

`--skew S` gives a share S of the requests one session, which the service pins to one worker
however loaded; with a small KV pool that worker parks streams, and migration moves them to
the other workers. Both runs use the same requests and warm-ups; only the router's migration
setting differs between them.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from kvserve.bench.serve_dataset import BenchRequest

HOT_SESSION = "kvserve-bench-hot"
MODES = ("migration on", "migration off")


def apply_skew(requests: list[BenchRequest], share: float, seed: int) -> list[BenchRequest]:
    """Give `share` of the requests (a seeded random pick) the one hot session."""
    if share <= 0 or not requests:
        return requests
    rng = np.random.default_rng(seed + 104729)
    hot = set(rng.choice(len(requests), size=round(share * len(requests)), replace=False).tolist())
    for i in hot:
        requests[i].session_id = HOT_SESSION
    return requests


def moved_streams(router: Any) -> int:
    import ray

    info = ray.get(router.server_info.remote())
    return int(sum(w["stats"].get("migration_streams_in", 0) for w in info["workers"]))


def compare_migration(
    a: argparse.Namespace, make_client: Callable[[], Any], requests: list[BenchRequest],
    warmups: list[BenchRequest], bench_one: Callable, record: Callable,
) -> dict[str, Any]:
    """Run the requests with migration on, then off; record each; the streams moved in each."""
    import ray

    from kvserve.router.router import NAMESPACE, ROUTER_NAME

    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    moved: dict[str, int] = {}
    for mode in MODES:
        ray.get(router.set_migration.remote(mode == "migration on"))
        before = moved_streams(router)
        record(f"{a.target}, {mode}", *asyncio.run(bench_one(make_client(), requests, warmups, a)))
        moved[mode] = moved_streams(router) - before
        print(f"bench serve: {mode}: {moved[mode]} streams moved", flush=True)
    return moved
