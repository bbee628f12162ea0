"""Moving streams between workers: planned migrations, explicit moves, and drains.

A running stream moves live (`router/live_move.py`): pre-copy rounds while it keeps decoding,
then a short final stage; its client's stream goes on. A waiting or parked stream (or where
a live move cannot run: a windowed stream, another block size) moves by snapshot, in three
worker calls: export on the source (the snapshot stays in Ray's object store and goes from
there straight to the target, never through the router), import on the target, then
hand-over on the source (its consumer learns where the stream went). A target that fails
keeps nothing and the stream goes back to its source.

A drained worker's sessions move too: each session's latest prompt blocks that the worker's
host tier still caches go to the session's new worker, so its next turn is a prefix hit.
So do those of a session whose affinity gave way (its worker over the imbalance bound or
full): the copy runs in the background, a bounded number at once, while the turn that moved
it is served.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from typing import Any

from ray.exceptions import RayActorError

from kvserve.router.live_move import LiveMoveConfig, MoveFailed, RayWorker, live_move
from kvserve.router.metrics import MigrationMetrics
from kvserve.router.migration import (
    MigrationConfig,
    Move,
    ParkedStream,
    RunningStream,
    WorkerState,
    drain_target,
    plan_moves,
    plan_rebalance,
)
from kvserve.router.policy import WorkerView
from kvserve.workers.worker_actor import stop_worker

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.2


class StreamMover:
    def __init__(
        self, cfg: MigrationConfig, handles: list[Any], views: list[WorkerView],
        sessions: OrderedDict[str, int], max_sessions: int,
        metrics: MigrationMetrics | None = None, roles: list[str] | None = None,
    ) -> None:
        self.cfg = cfg
        # workers' roles (the router's list): prefill workers take no moved streams
        self.roles = roles if roles is not None else []
        self.metrics = metrics  # Prometheus export of `counts` and the drain states
        self.sessions = sessions  # the router's session -> worker map (shared, not copied)
        self.max_sessions = max_sessions
        self.session_prefix: OrderedDict[str, list[int]] = OrderedDict()  # latest prompt
        self.request_sessions: OrderedDict[str, str] = OrderedDict()  # request -> its session
        self.handles = handles
        self.views = views
        self.parked: dict[int, list[ParkedStream]] = {}
        self.moving: set[str] = set()
        self.last_moved: dict[str, float] = {}
        # planned moves' device blocks per request: (target, blocks, when the move ended;
        # inf while under way), until a poll of the target sent after that has seen them
        self.incoming: dict[str, tuple[int, int, float]] = {}
        self.draining: set[int] = set()
        self.drained: set[int] = set()
        self.counts: dict[int, Counter[str]] = {v.idx: Counter() for v in views}
        self._tasks: set[asyncio.Task] = set()
        self._session_copies: set[asyncio.Task] = set()
        self._drains: dict[int, asyncio.Task] = {}  # drains under way, by worker
        self.block_size = 16  # the engines' (set by the router once they answered)
        # moves a worker takes part in at once (as source or target), whoever starts them
        self._per_worker: dict[int, asyncio.Semaphore] = {}

    # ---- the router's view ------------------------------------------------------------------
    def observe(self, idx: int, load: dict[str, Any], sent_at: float) -> None:
        """Worker `idx`'s load, asked for at `sent_at`: moves to it that had ended by then
        show in it (the stream parked there, or its blocks taken)."""
        self.parked[idx] = [
            ParkedStream(p["request_id"], p["parked_s"], p["blocks_needed"], p["kv_bytes"])
            for p in load.get("parked_streams", ())
        ]
        self.incoming = {r: m for r, m in self.incoming.items()
                         if not (m[0] == idx and m[2] < sent_at)}

    def reserved(self) -> dict[int, int]:
        """Device blocks per worker that planned moves to it take beyond its last poll."""
        out: Counter[int] = Counter()
        for dst, blocks, _ in self.incoming.values():
            out[dst] += blocks
        return dict(out)

    def note_session(self, session: str, hashes: list[int]) -> None:
        """Remember the block hashes of a session's latest prompt (to move its prefix)."""
        self.session_prefix[session] = hashes
        self.session_prefix.move_to_end(session)
        if len(self.session_prefix) > self.max_sessions:
            self.session_prefix.popitem(last=False)

    def session_routed(self, session: str, old: int | None, new: int, hashes: list[int],
                       exclude: list[int]) -> bool:
        """A session's turn was routed to `new`; when affinity gave way (its worker `old` is
        alive, not excluded by a retry, but over the imbalance bound or full), copy the
        prompt's blocks `old` caches on host to `new`'s host tier in the background.
        Returns whether a copy started (at most `max_inflight` run at once; more are skipped:
        that turn computes its prefix on the new worker, as without a copy)."""
        if old is None or old == new or old in exclude or not hashes:
            return False
        v = self.views[old]
        if (not v.alive or old in self.draining or old in self.drained
                or hashes[0] not in v.held_host  # nothing of it on that host tier
                or len(self._session_copies) >= max(1, self.cfg.max_inflight)):
            return False
        task = asyncio.create_task(self._follow(session, old, new, hashes))
        self._session_copies.add(task)
        task.add_done_callback(self._session_copies.discard)
        return True

    async def _follow(self, session: str, src: int, dst: int, hashes: list[int]) -> None:
        try:
            blocks = await asyncio.wait_for(self._copy_prefix(src, dst, hashes),
                                            self.cfg.import_timeout_s)
        except Exception as e:  # the next turn computes the prefix: slower, still correct
            log.warning("copying session %s's prefix from worker %d to %d failed: %s",
                        session, src, dst, e)
            return
        if blocks:
            self.counts[dst]["sessions_in"] += 1
            if self.metrics:
                self.metrics.session_moved(self.views[dst].worker_id)

    async def _copy_prefix(self, src: int, dst: int, hashes: list[int]) -> int:
        """Copy the leading blocks of `hashes` cached on `src`'s host tier to `dst`'s; the
        record goes from object store to object store, not through the router."""
        size_ref, data_ref = self.handles[src].export_prefix.remote(hashes)
        if not await size_ref:
            return 0
        res = await self.handles[dst].import_prefix.remote(data_ref)
        blocks = int(res.get("blocks", 0))
        self.counts[dst]["session_blocks_in"] += blocks
        return blocks

    def states(self) -> list[WorkerState]:
        return [WorkerState(v.idx, v.alive and v.idx not in self.drained, v.idx in self.draining,
                            v.waiting, v.kv_blocks_free, v.kv_blocks_total,
                            self.parked.get(v.idx, []),
                            [RunningStream(s["request_id"], s["tokens"], s["blocks"])
                             for s in v.streams if s.get("state") == "running"],
                            self.block_size, self._role(v.idx) != "prefill")
                for v in self.views]

    def _role(self, idx: int) -> str:
        return self.roles[idx] if idx < len(self.roles) else "mixed"

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
        states = self.states()
        planned = [(m, "parked", "snapshot") for m in plan_moves(
            states, self.cfg, self.moving, self.last_moved, now, self.reserved())]
        for m, _, _ in planned:
            self.moving.add(m.request_id)  # counted now: the rebalance plan sees it in flight
        planned += [(m, "rebalance", "live") for m in plan_rebalance(
            states, self.cfg, self.moving, self.last_moved, now, self.reserved())]
        for m, reason, method in planned:
            self.moving.add(m.request_id)  # counted now: the next tick sees it in flight
            self.incoming[m.request_id] = (m.dst, m.blocks, float("inf"))
            task = asyncio.create_task(self.move(m.request_id, m.src, m.dst, reason, method))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(lambda t, m=m: self._landed(m, t))

    def _landed(self, m: Move, task: asyncio.Task) -> None:
        """A planned move ended: its blocks stay reserved on the target until a poll sees
        them there; a move that failed took nothing there."""
        ok = not task.cancelled() and task.exception() is None and "error" not in task.result()
        if ok:
            self.incoming[m.request_id] = (m.dst, m.blocks, time.monotonic())
        else:
            self.incoming.pop(m.request_id, None)

    # ---- one move -----------------------------------------------------------------------------
    async def move(self, request_id: str, src: int, dst: int, reason: str = "operator",
                   method: str = "auto") -> dict[str, Any]:
        """Move one unfinished request's stream from worker `src` to `dst`.

        `method`: "live" (a running stream, pre-copied while it decodes), "snapshot"
        (stop-and-copy), or "auto": live where the stream runs and both workers can, else by
        snapshot. The answer: {"request_id", "src", "dst", "method", "bytes", "stall_ms",
        "rounds"}, or {"error", "refused"} (refused: the target has no room; the stream is
        untouched where it was)."""
        if src == dst:
            return {"error": "source and target are the same worker", "refused": True}
        self.moving.add(request_id)
        self.last_moved[request_id] = time.monotonic()
        try:
            a, b = (self._slot(i) for i in sorted((src, dst)))  # in order: no deadlock
            async with a, b:
                res = await self._move_by(request_id, src, dst, method)
        finally:
            self.moving.discard(request_id)
            # the interval runs from the move's end: one that failed after a long import
            # timeout must not be retried by the very next round
            self.last_moved[request_id] = time.monotonic()
        outcome = "moved" if "error" not in res else "refused" if res.get("refused") else "failed"
        if self.metrics:
            self.metrics.stream_move(reason, res.get("method", method), outcome, res)
        if outcome == "moved":
            self._follow_session(request_id, src, dst)
        return res

    async def _move_by(self, rid: str, src: int, dst: int, method: str) -> dict[str, Any]:
        if method in ("auto", "live") and self.cfg.live:
            try:
                r = await live_move(RayWorker(self.handles[src], self.views[src].worker_id),
                                    RayWorker(self.handles[dst], self.views[dst].worker_id),
                                    dst, rid, self._live_cfg())
            except MoveFailed as e:
                if not (method == "auto" and e.snapshot):
                    if e.side == "target" and not e.refused:
                        self._target_failed(dst)
                    return {"error": str(e), "refused": e.refused, "method": "live",
                            "side": e.side}
            else:
                n = r.bytes
                self.counts[src].update(out=1, bytes_out=n)
                self.counts[dst].update({"in": 1, "bytes_in": n})
                if self.metrics:
                    self.metrics.moved(self.views[src].worker_id, self.views[dst].worker_id, n)
                return {"request_id": rid, "src": src, "dst": dst, "method": "live",
                        "bytes": n, "stall_ms": r.stall_s * 1e3, "rounds": r.rounds,
                        "precopy_ms": r.precopy_s * 1e3}
        elif method == "live":
            return {"error": "live moves are turned off (migration_live)", "refused": True,
                    "method": "live"}
        t0 = time.monotonic()
        res = await self._move(rid, src, dst)
        res["method"] = "snapshot"
        if "error" not in res:
            res.update(stall_ms=(time.monotonic() - t0) * 1e3, rounds=1)
        return res

    def _slot(self, idx: int) -> asyncio.Semaphore:
        sem = self._per_worker.get(idx)
        if sem is None:
            sem = self._per_worker[idx] = asyncio.Semaphore(max(1, self.cfg.max_inflight))
        return sem

    def _live_cfg(self) -> LiveMoveConfig:
        return LiveMoveConfig(copy_share=self.cfg.copy_share, growth_tokens=self.cfg.growth_tokens,
                              call_timeout_s=self.cfg.import_timeout_s)

    def _target_failed(self, dst: int) -> None:
        self.counts[dst]["failures"] += 1
        if self.metrics:
            self.metrics.failed(self.views[dst].worker_id)

    def _follow_session(self, rid: str, src: int, dst: int) -> None:
        """The session of a moved request follows it: its next turn finds its KV there."""
        session = self.request_sessions.get(rid)
        if session is not None and self.sessions.get(session) == src:
            self.sessions[session] = dst

    def note_request(self, request_id: str, session: str) -> None:
        self.request_sessions[request_id] = session
        if len(self.request_sessions) > self.max_sessions:
            self.request_sessions.popitem(last=False)

    async def _move(self, rid: str, src: int, dst: int) -> dict[str, Any]:
        meta_ref, data_ref = self.handles[src].export_stream.remote(rid)
        try:
            meta = await meta_ref
        except Exception as e:  # the source died: its consumers hear of it themselves
            return {"error": f"export failed: {e}"}
        if "error" in meta:  # finished or aborted meanwhile: nothing to move
            return {"error": meta["error"]}
        imported = asyncio.ensure_future(self._import(dst, data_ref))
        try:
            res = await asyncio.wait_for(asyncio.shield(imported), self.cfg.import_timeout_s)
        except Exception as e:  # died or stuck mid-import
            if isinstance(e, RayActorError):
                self.views[dst].alive = False  # until a poll finds it back
            else:  # a stuck import may still land: the target must not keep that copy
                imported.add_done_callback(lambda f: self._drop_late_import(f, dst, rid))
            res = {"error": f"{type(e).__name__}: {e}"}
        if "error" in res:
            self._target_failed(dst)
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
        if self.metrics:
            self.metrics.moved(self.views[src].worker_id, self.views[dst].worker_id, n)
        return {"request_id": rid, "src": src, "dst": dst, "bytes": n}

    async def _import(self, dst: int, data_ref: Any) -> dict[str, Any]:
        return await self.handles[dst].import_stream.remote(data_ref)

    def _drop_late_import(self, f: asyncio.Future, dst: int, rid: str) -> None:
        """An import the mover gave up on answered after all: abort the target's copy (the
        stream went back to its source)."""
        if not f.cancelled() and f.exception() is None and "error" not in f.result():
            log.warning("worker %d imported %s after the move timed out; aborting its copy",
                        dst, rid)
            self.handles[dst].abort.remote(rid)

    def add_worker(self, idx: int) -> None:
        """A worker joined (a resize): count its moves from zero."""
        self.counts[idx] = Counter()
        if self.metrics:
            self.metrics.add_worker(self.views[idx].worker_id)

    # ---- drain ----------------------------------------------------------------------------------
    def start_drain(self, idx: int, timeout_s: float) -> asyncio.Task:
        """Drain worker `idx` in the background; it stops taking requests at once. A drain
        already under way for it is the one returned."""
        task = self._drains.get(idx)
        if task is None or task.done():
            if idx not in self.drained:
                self._drain_state(idx, "draining")  # before the caller's next pick
            task = asyncio.create_task(self._drain(idx, timeout_s))
            self._drains[idx] = task
        return task

    async def drain(self, idx: int, timeout_s: float) -> dict[str, Any]:
        """Stop routing to worker `idx`, move its streams away, then stop it for good."""
        return await asyncio.shield(self.start_drain(idx, timeout_s))

    async def _drain(self, idx: int, timeout_s: float) -> dict[str, Any]:
        if idx in self.drained:
            return {"worker": idx, "moved": 0, "drained": True}
        deadline = time.monotonic() + timeout_s
        moved = 0
        sem = asyncio.Semaphore(max(1, self.cfg.max_inflight))

        async def one(rid: str, dst: int) -> bool:
            async with sem:  # live where the stream runs (or by snapshot where it cannot)
                res = await self.move(rid, idx, dst, "drain", "auto")
                if res.get("refused") and res.get("method") == "live":  # no room there now:
                    res = await self.move(rid, idx, dst, "drain", "snapshot")  # parks there
                return "error" not in res

        while True:
            ids = [r for r in await self.handles[idx].unfinished_ids.remote()
                   if r not in self.moving]
            if not ids and self.views[idx].inflight == 0:
                break
            if time.monotonic() > deadline:
                self._drain_state(idx, "serving")
                return {"worker": idx, "moved": moved, "drained": False,
                        "error": f"{len(ids)} streams still on worker {idx} after {timeout_s} s"}
            load = {v.idx: v.inflight for v in self.views}
            jobs = []
            for rid in ids:
                dst = drain_target(self.states(), idx, load)
                if dst is None:
                    self._drain_state(idx, "serving")
                    return {"worker": idx, "moved": moved, "drained": False,
                            "error": "no other worker is available to take its streams"}
                load[dst] = load.get(dst, 0) + 1
                jobs.append(one(rid, dst))
            moved += sum(await asyncio.gather(*jobs))
            await asyncio.sleep(DRAIN_POLL_S)
        sessions = await self._move_sessions(idx)
        stop_worker(self.handles[idx])
        self.drained.add(idx)
        self._drain_state(idx, "drained")
        self.views[idx].alive = False
        log.warning("worker %d drained (%d streams, %d sessions moved) and stopped",
                    idx, moved, sessions)
        return {"worker": idx, "moved": moved, "sessions": sessions, "drained": True}

    def _drain_state(self, idx: int, state: str) -> None:
        """Worker `idx` is serving again, draining or drained (sets and gauge agree)."""
        if state == "draining":
            self.draining.add(idx)
        else:
            self.draining.discard(idx)
        if self.metrics:
            self.metrics.drain_state(self.views[idx].worker_id, state)

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
                await self._copy_prefix(src, dst, hashes)
            self.sessions[session] = dst
            self.counts[dst]["sessions_in"] += 1
            if self.metrics:
                self.metrics.session_moved(self.views[dst].worker_id)
            moved += 1
        return moved
