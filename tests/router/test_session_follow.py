"""A session whose affinity gives way (its worker over the imbalance bound) carries its
host-cached prefix to its new worker: the real Affinity policy decides, the mover copies
between fake worker handles (one class under test, no Ray)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

from kvserve.router.migration import MigrationConfig
from kvserve.router.mover import StreamMover
from kvserve.router.policy import Affinity, RouteRequest, WorkerView

HASHES = [11, 12, 13]


class _Call:
    def __init__(self, f: Any) -> None:
        self.remote = f


async def _value(v: Any) -> Any:
    return v


def _setup(old_load: int, held_host: set[int]) -> tuple[StreamMover, list[WorkerView], list]:
    copies: list[tuple] = []
    views = [WorkerView(0, "worker-0", alive=True, inflight=old_load, held_host=held_host),
             WorkerView(1, "worker-1", alive=True)]

    def export(hashes: list[int]) -> tuple:
        copies.append(("export", 0, list(hashes)))
        return _value(4096), b"record"

    async def import_prefix(data: bytes) -> dict[str, Any]:
        copies.append(("import", 1, data))
        return {"blocks": 2}

    handles = [SimpleNamespace(export_prefix=_Call(export)),
               SimpleNamespace(import_prefix=_Call(import_prefix))]
    return StreamMover(MigrationConfig(), handles, views, OrderedDict(), 100), views, copies


def _route(mover: StreamMover, views: list[WorkerView], exclude: list[int]) -> tuple[int, bool]:
    d = Affinity(max_imbalance=2).choose(views, RouteRequest(HASHES, session_worker=0))

    async def run() -> bool:
        started = mover.session_routed("s", 0, d.idx, HASHES, exclude)
        await asyncio.gather(*mover._session_copies)
        return started

    return d.idx, asyncio.run(run())


def test_affinity_gives_way_and_the_prefix_follows():
    mover, views, copies = _setup(old_load=3, held_host={11, 12})  # 3 > 0 + max_imbalance 2
    assert _route(mover, views, []) == (1, True)
    assert copies == [("export", 0, HASHES), ("import", 1, b"record")]
    assert mover.stats(1)["migration_sessions_in"] == 1
    assert mover.stats(1)["migration_session_blocks_in"] == 2


def test_no_copy_while_affinity_holds_or_when_nothing_is_on_host():
    mover, views, copies = _setup(old_load=2, held_host={11})  # within the bound: stays
    assert _route(mover, views, []) == (0, False)
    mover, views, copies = _setup(old_load=3, held_host={12})  # not the leading block
    assert _route(mover, views, []) == (1, False)
    mover, views, copies = _setup(old_load=3, held_host={11})  # a retry: worker 0 died
    assert _route(mover, views, [0]) == (1, False)
    assert copies == []
