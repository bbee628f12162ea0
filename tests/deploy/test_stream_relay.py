"""StreamRelay (no Ray): a stream that moves to a worker the ingress has no handle for yet
(one a resize started) waits for the async move callback to fetch it, then goes on there
through the replica's token path."""

from __future__ import annotations

import asyncio
from typing import Any

from test_token_demux import FakeWorker, Remote

from kvserve.deploy.stream_relay import StreamRelay


def _worker(name: str, chunks: list[dict[str, Any]]) -> FakeWorker:
    """A worker that answers `start` / `start_resume` by sending `chunks` on the caller's
    subscription, under the stream key the caller gave (their last argument)."""
    w = FakeWorker()
    w.name = name  # type: ignore[attr-defined]

    async def started(sub_id: str, *args: Any, **kw: Any) -> bool:
        w.streams[sub_id].items.put_nowait({"batch": {args[-1]: chunks}})
        return True

    w.start = Remote(started)  # type: ignore[attr-defined]
    w.start_resume = Remote(started)  # type: ignore[attr-defined]
    return w


def test_a_move_to_a_new_worker_waits_for_its_handle():
    tail = [{"token_ids": [3], "finish_reason": "length"}]
    first = [{"token_ids": [1, 2], "finish_reason": None}, {"moved_to": 1}]
    workers: list[Any] = [_worker("worker-0", first)]
    moves: list[tuple[int, int]] = []

    async def on_move(src: int, dst: int) -> None:
        moves.append((src, dst))
        await asyncio.sleep(0)
        workers.append(_worker("worker-1", tail))  # the ingress fetched the new handle

    async def run() -> tuple[list[dict[str, Any]], StreamRelay]:
        relay = StreamRelay(workers, 0, "r", on_move, "r@1")
        return [c async for c in relay.chunks([5, 6], {})], relay

    got, relay = asyncio.run(run())
    assert [c["token_ids"] for c in got] == [[1, 2], [3]]
    assert moves == [(0, 1)] and relay.idx == 1 and relay.worker.name == "worker-1"
