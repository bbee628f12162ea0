"""The worker actor's side of stream moves: export, import, hand-over and resume; and of
session moves: a session's cached prefix blocks exported and imported between host tiers.

The router moves a stream in three calls: `export_stream` here (two returns: a small
verdict and the snapshot bytes, which stay in Ray's object store and go straight to the
target), `import_stream` on the target, then `hand_over` here (the consumer learns where
its stream went) or, when the target failed, `import_stream` here again (the stream is
back in this worker's queue, its consumer none the wiser).
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from kvserve.workers.engine.async_engine import AsyncLLMEngine


class StreamMoves:
    """Mixin of WorkerActor (which owns `engine` and `worker_id`)."""

    engine: AsyncLLMEngine
    worker_id: str
    # fault injection (tests, drills): seconds an import holds its stream before answering,
    # so a target can die or time out with the stream already in its engine
    import_delay_s: float = 0.0

    @ray.method(num_returns=2)
    async def export_stream(self, request_id: str) -> tuple[dict[str, Any], bytes]:
        """({"bytes": n} or {"error": why}, snapshot); the stream leaves this engine."""
        try:
            data = await self.engine.export_stream(request_id)
        except Exception as e:  # finished, aborted or unknown meanwhile: nothing moves
            return {"error": str(e)}, b""
        return {"bytes": len(data), "worker_id": self.worker_id}, data

    async def import_stream(self, data: bytes) -> dict[str, Any]:
        """Queue a snapshot's stream as parked here: {"request_id"} or {"error"}."""
        if not data:
            return {"error": "empty snapshot"}
        try:
            rid = await self.engine.import_stream(data)
        except Exception as e:
            return {"error": str(e)}
        if self.import_delay_s:
            await asyncio.sleep(self.import_delay_s)
        return {"request_id": rid}

    def set_import_delay(self, seconds: float) -> float:
        """Hold each import's answer this long (fault injection); returns the old delay."""
        old, self.import_delay_s = self.import_delay_s, max(0.0, float(seconds))
        return old

    async def hand_over(self, request_id: str, target: int) -> bool:
        """Tell the request's consumer here that it continues on worker `target`."""
        return await self.engine.hand_over(request_id, target)

    def unfinished_ids(self) -> list[str]:
        return self.engine.unfinished_ids()

    @ray.method(num_returns=2)
    async def export_prefix(self, hashes: list[int]) -> tuple[int, bytes]:
        """(bytes, record) of the leading prefix blocks of `hashes` cached on host here."""
        data = await self.engine.export_prefix(hashes)
        return len(data), data

    async def import_prefix(self, data: bytes) -> dict[str, Any]:
        """Cache a session's prefix blocks from another worker: {"blocks"} or {"error"}."""
        if not data:
            return {"blocks": 0}
        try:
            return {"blocks": await self.engine.import_prefix(data)}
        except Exception as e:
            return {"error": str(e)}
