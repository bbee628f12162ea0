"""StreamRelay (no Ray): a stream that moves to a worker the ingress has no handle for yet
(one a resize started) waits for the async move callback to fetch it, then goes on there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from kvserve.deploy.stream_relay import StreamRelay


async def _ready(x: Any) -> Any:
    return x


async def _chunks(items: list[dict[str, Any]]) -> AsyncIterator[Any]:
    for item in items:
        yield _ready(item)  # the relay awaits each item, as it does an ObjectRef


def _worker(name: str, items: list[dict[str, Any]]) -> SimpleNamespace:
    return SimpleNamespace(name=name, resume=SimpleNamespace(
        remote=lambda request_id, slot_id: _chunks(items)))


def test_a_move_to_a_new_worker_waits_for_its_handle():
    tail = [{"token_ids": [3], "finish_reason": "length"}]
    workers: list[Any] = [_worker("worker-0", [])]
    moves: list[tuple[int, int]] = []

    async def on_move(src: int, dst: int) -> None:
        moves.append((src, dst))
        await asyncio.sleep(0)
        workers.append(_worker("worker-1", tail))  # the ingress fetched the new handle

    async def run() -> list[dict[str, Any]]:
        relay = StreamRelay(workers, 0, "r", on_move, "r@1")
        first = _chunks([{"token_ids": [1, 2], "finish_reason": None}, {"moved_to": 1}])
        return [c async for c in relay.chunks(first)], relay

    got, relay = asyncio.run(run())
    assert [c["token_ids"] for c in got] == [[1, 2], [3]]
    assert moves == [(0, 1)] and relay.idx == 1 and relay.worker.name == "worker-1"
