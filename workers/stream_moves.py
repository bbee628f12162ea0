"""The worker actor's side of stream moves: export, import, hand-over and resume; live
moves of running streams (reserve, pre-copy rounds, final stage, commit; see
workers/engine/live_move.py); and session moves: a session's cached prefix blocks exported
and imported between host tiers.

The router moves a stream in three calls: `export_stream` here (two returns: a small
verdict and the snapshot bytes, which stay in Ray's object store and go straight to the
target), `import_stream` on the target, then `hand_over` here (the consumer learns where
its stream went) or, when the target failed, `import_stream` here again (the stream is
back in this worker's queue, its consumer none the wiser).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from kvserve.workers.engine.async_engine import AsyncLLMEngine
from kvserve.workers.engine.live_move import LEASE_S, MoveRefused


async def _answer(call: Any) -> Any:
    try:
        return await call
    except MoveRefused as e:
        return {"error": str(e), "refused": True, "snapshot": e.snapshot}
    except Exception as e:  # a fault on this side: the move is called off
        return {"error": f"{type(e).__name__}: {e}", "refused": False}


async def _answer2(call: Any) -> tuple[Any, Any]:
    res = await _answer(call)
    return (res, None) if isinstance(res, dict) else res


class StreamMoves:
    """Mixin of WorkerActor (which owns `engine` and `worker_id`)."""

    engine: AsyncLLMEngine
    worker_id: str
    # fault injection (tests, drills): seconds an import, or a live move's write, holds its
    # answer with what it brought already in the engine, so a target can die or time out then
    import_delay_s: float = 0.0
    commit_faults: int = 0  # fault injection: live commits still to fail (`fail_commits`)

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

    def fail_commits(self, n: int) -> int:
        """Fail the next `n` live commits here as a fault would (the reservation dropped);
        fault injection for tests and drills. Returns the old count."""
        old, self.commit_faults = self.commit_faults, max(0, int(n))
        return old

    async def hand_over(self, request_id: str, target: int) -> bool:
        """Tell the request's consumer here that it continues on worker `target`."""
        return await self.engine.hand_over(request_id, target)

    def unfinished_ids(self) -> list[str]:
        return self.engine.unfinished_ids()

    # ---- live moves: every answer is a dict, {"error": why, "refused": bool} on failure ----
    # (refused: this worker cannot do it and nothing changed here; otherwise a fault)
    async def live_begin(self, request_id: str, target: str) -> dict[str, Any]:
        return await _answer(self.engine.live_begin(request_id, target))

    @ray.method(num_returns=2)
    async def live_round(self, request_id: str, copy_share: float,
                         max_blocks: int | None = None) -> tuple[dict[str, Any], Any]:
        """(meta, block bytes): the router awaits the meta, the bytes go to the target."""
        return await _answer2(self.engine.live_round(request_id, copy_share, max_blocks))

    @ray.method(num_returns=2)
    async def live_freeze(self, request_id: str) -> tuple[dict[str, Any], Any]:
        return await _answer2(self.engine.live_freeze(request_id))

    async def live_finish(self, request_id: str, target: int) -> bool:
        return await self.engine.live_finish(request_id, target)

    async def live_abandon(self, request_id: str) -> bool:
        return await self.engine.live_abandon(request_id)

    async def live_reserve(self, info: dict[str, Any], growth_tokens: int,
                           lease_s: float = LEASE_S) -> dict[str, Any]:
        return await _answer(self.engine.live_reserve(info, growth_tokens, lease_s))

    async def live_touch(self, request_id: str) -> bool:
        return await self.engine.live_touch(request_id)

    async def live_write(self, request_id: str, meta: dict[str, Any], data: Any) -> dict[str, Any]:
        written = await _answer(self.engine.live_write(request_id, meta, data))
        if self.import_delay_s:
            await asyncio.sleep(self.import_delay_s)
        return written if isinstance(written, dict) else {"written": written}

    async def live_commit(self, request_id: str, meta: dict[str, Any], data: Any) -> dict[str, Any]:
        if self.commit_faults > 0:  # fault injection: as a target that failed mid-commit
            self.commit_faults -= 1
            await self.engine.live_cancel(request_id)
            return {"error": "injected fault: the commit failed", "refused": False}
        rid = await _answer(self.engine.live_commit(request_id, meta, data))
        return rid if isinstance(rid, dict) else {"request_id": rid}

    async def live_cancel(self, request_id: str) -> bool:
        return await self.engine.live_cancel(request_id)

    def live_moves(self) -> dict[str, Any]:
        """Live moves under way here: {"out": [request ids], "in": [request ids]}."""
        return self.engine.live_moves()

    # ---- hand-offs after prefill (disaggregated serving; router/handoff.py) ----------------
    @ray.method(num_returns=2)
    async def handoff_freeze(self, request_id: str, wait_s: float) -> tuple[dict[str, Any], Any]:
        """Wait (up to `wait_s`) until hand-off request `request_id` has its first token
        out and is held, then its final stage: (meta with its state, its blocks), as
        `live_freeze`. Without a stream to send: ({"finished": True} (its first token ended
        it) or {"gone": why}, None)."""
        got = await self.engine.handoff_wait(request_id, wait_s)
        if not got.get("held"):
            return got, None
        frozen = self.engine.take_frozen(request_id)  # read as it was held
        if frozen is not None:
            return frozen
        t0 = time.perf_counter()
        meta, data = await _answer2(self.engine.live_freeze(request_id))
        meta["freeze_s"] = time.perf_counter() - t0
        return meta, data

    async def handoff_fail(self, request_id: str, why: str) -> bool:
        """End a held hand-off request with an error (the failure policy is `fail`)."""
        return await self.engine.handoff_fail(request_id, why)

    def handoffs(self) -> dict[str, Any]:
        """Hand-off requests here: {"prefilling": [ids], "held": [ids]}."""
        return self.engine.handoffs()

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
