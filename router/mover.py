"""Moving streams between workers: planned migrations, explicit moves, and drains.

A move is three worker calls: export on the source (the snapshot stays in Ray's object
store and goes from there straight to the target, never through the router), import on
the target, then hand-over on the source (its consumer learns where the stream went). A
target that fails keeps nothing and the stream goes back to its source's queue.

A drained worker's sessions move too: each session's latest prompt blocks that the worker's
host tier still caches go to the session's new worker, so its next turn is a prefix hit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from typing import Any

import ray
from ray.exceptions import RayActorError

from kvserve.router.migration import (
    MigrationConfig,
    ParkedStream,
    WorkerState,
    drain_target,
    plan_moves,
)
from kvserve.router.policy import WorkerView

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.2


class StreamMover:
    def __init__(
        self, cfg: MigrationConfig, handles: list[Any], views: list[WorkerView],
        sessions: OrderedDict[str, int], max_sessions: int,
    ) -> None:
        self.cfg = cfg
        self.sessions = sessions  # the router's session -> worker map (shared, not copied)
        self.max_sessions = max_sessions
        self.session_prefix: OrderedDict[str, list[int]] = OrderedDict()  # latest prompt
        self.handles = handles
        self.views = views
        self.parked: dict[int, list[ParkedStream]] = {}
        self.moving: set[str] = set()
        self.last_moved: dict[str, float] = {}
        self.draining: set[int] = set()
        self.drained: set[int] = set()
        self.counts: dict[int, Counter[str]] = {v.idx: Counter() for v in views}
        self._tasks: set[asyncio.Task] = set()

    # ---- the router's view ------------------------------------------------------------------
    def observe(self, idx: int, load: dict[str, Any]) -> None:
        self.parked[idx] = [
            ParkedStream(p["request_id"], p["parked_s"], p["blocks_needed"], p["kv_bytes"])
            for p in load.get("parked_streams", ())
        ]

    def note_session(self, session: str, hashes: list[int]) -> None:
        """Remember the block hashes of a session's latest prompt (to move its prefix)."""
        self.session_prefix[session] = hashes
        self.session_prefix.move_to_end(session)
        if len(self.session_prefix) > self.max_sessions:
            self.session_prefix.popitem(last=False)

    def states(self) -> list[WorkerState]:
        return [WorkerState(v.idx, v.alive and v.idx not in self.drained, v.idx in self.draining,
                            v.waiting, v.kv_blocks_free, v.kv_blocks_total,
                            self.parked.get(v.idx, []))
                for v in self.views]

    def stats(self, idx: int) -> dict[str, float]:
        c = self.counts[idx]
        parked = self.parked.get(idx, [])
        return {"migration_streams_out": c["out"], "migration_streams_in": c["in"],
                "migration_bytes_out": c["bytes_out"], "migration_bytes_in": c["bytes_in"],
                "migration_failures": c["failures"],
                "migration_sessions_in": c["sessions_in"],
                "migration_session_blocks_in": c["session_blocks_in"],
                "parked_kv_bytes": sum(p.kv_bytes for p in parked),
                "draining": float(idx in self.draining), "drained": float(idx in self.drained)}

    # ---- planned migrations -----------------------------------------------------------------
    def tick(self) -> None:
        """Start the moves the planner picks from the latest poll."""
        now = time.monotonic()
        self.last_moved = {r: t for r, t in self.last_moved.items()
                           if now - t < self.cfg.min_interval_s}
        for m in plan_moves(self.states(), self.cfg, self.moving, self.last_moved, now):
            self.moving.add(m.request_id)  # counted now: the next tick sees it in flight
            task = asyncio.create_task(self.move(m.request_id, m.src, m.dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ---- one move -----------------------------------------------------------------------------
    async def move(self, request_id: str, src: int, dst: int) -> dict[str, Any]:
        """Move one unfinished request's stream from worker `src` to `dst`."""
        if src == dst:
            return {"error": "source and target are the same worker"}
        self.moving.add(request_id)
        self.last_moved[request_id] = time.monotonic()
        try:
            return await self._move(request_id, src, dst)
        finally:
            self.moving.discard(request_id)

    async def _move(self, rid: str, src: int, dst: int) -> dict[str, Any]:
        meta_ref, data_ref = self.handles[src].export_stream.remote(rid)
        try:
            meta = await meta_ref
        except Exception as e:  # the source died: its consumers hear of it themselves
            return {"error": f"export failed: {e}"}
        if "error" in meta:  # finished or aborted meanwhile: nothing to move
            return {"error": meta["error"]}
        try:
            res = await asyncio.wait_for(self.handles[dst].import_stream.remote(data_ref),
                                         self.cfg.import_timeout_s)
        except Exception as e:  # died or stuck mid-import
            if isinstance(e, RayActorError):
                self.views[dst].alive = False  # until a poll finds it back
            res = {"error": f"{type(e).__name__}: {e}"}
        if "error" in res:
            self.counts[dst]["failures"] += 1
            log.warning("moving %s to worker %d failed (%s); it goes back to worker %d",
                        rid, dst, res["error"], src)
            back = await self.handles[src].import_stream.remote(data_ref)
            if "error" in back:  # cannot happen short of a bug: end the stream, do not hang it
                log.error("worker %d could not take %s back: %s", src, rid, back["error"])
                self.handles[src].abort.remote(rid)
            return {"error": res["error"], "returned": "error" not in back}
        if not await self.handles[src].hand_over.remote(rid, dst):
            self.handles[dst].abort.remote(rid)  # the client left during the move
            return {"error": f"request {rid!r} was aborted during the move"}
        n = int(meta["bytes"])
        self.counts[src].update(out=1, bytes_out=n)
        self.counts[dst].update({"in": 1, "bytes_in": n})
        return {"request_id": rid, "src": src, "dst": dst, "bytes": n}

    # ---- drain ----------------------------------------------------------------------------------
    async def drain(self, idx: int, timeout_s: float) -> dict[str, Any]:
        """Stop routing to worker `idx`, move its streams away, then stop it for good."""
        if idx in self.drained:
            return {"worker": idx, "moved": 0, "drained": True}
        self.draining.add(idx)
        deadline = time.monotonic() + timeout_s
        moved = 0
        sem = asyncio.Semaphore(max(1, self.cfg.max_inflight))

        async def one(rid: str, dst: int) -> bool:
            async with sem:
                return "error" not in await self.move(rid, idx, dst)

        while True:
            ids = [r for r in await self.handles[idx].unfinished_ids.remote()
                   if r not in self.moving]
            if not ids and self.views[idx].inflight == 0:
                break
            if time.monotonic() > deadline:
                self.draining.discard(idx)
                return {"worker": idx, "moved": moved, "drained": False,
                        "error": f"{len(ids)} streams still on worker {idx} after {timeout_s} s"}
            load = {v.idx: v.inflight for v in self.views}
            jobs = []
            for rid in ids:
                dst = drain_target(self.states(), idx, load)
                if dst is None:
                    self.draining.discard(idx)
                    return {"worker": idx, "moved": moved, "drained": False,
                            "error": "no other worker is available to take its streams"}
                load[dst] = load.get(dst, 0) + 1
                jobs.append(one(rid, dst))
            moved += sum(await asyncio.gather(*jobs))
            await asyncio.sleep(DRAIN_POLL_S)
        sessions = await self._move_sessions(idx)
        ray.kill(self.handles[idx], no_restart=True)
        self.draining.discard(idx)
        self.drained.add(idx)
        self.views[idx].alive = False
        log.warning("worker %d drained (%d streams, %d sessions moved) and stopped",
                    idx, moved, sessions)
        return {"worker": idx, "moved": moved, "sessions": sessions, "drained": True}

    async def _move_sessions(self, src: int) -> int:
        """Re-pin `src`'s sessions on the other workers, their cached prefixes with them."""
        load = {v.idx: v.inflight for v in self.views}
        moved = 0
        for session in [s for s, i in self.sessions.items() if i == src]:
            dst = drain_target(self.states(), src, load)
            if dst is None:
                break
            load[dst] = load.get(dst, 0) + 1
            hashes = self.session_prefix.get(session)
            if hashes:
                size_ref, data_ref = self.handles[src].export_prefix.remote(hashes)
                if await size_ref:
                    res = await self.handles[dst].import_prefix.remote(data_ref)
                    self.counts[dst]["session_blocks_in"] += res.get("blocks", 0)
            self.sessions[session] = dst
            self.counts[dst]["sessions_in"] += 1
            moved += 1
        return moved
