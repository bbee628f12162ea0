"""One live move of a running stream, driven from the router (the protocol is described in
workers/engine/live_move.py): reserve on the target, pre-copy rounds while the source keeps
decoding, the final stage, commit, then the source frees the stream.

The KV bytes of each round are a Ray object returned by the source and passed by reference
to the target: they go from object store to object store, never through the router. A
round's write on the target overlaps the source's next round.

`Worker` adapts a worker for the protocol: `RayWorker` over an actor handle; tests drive
in-process worker bodies through the same calls (`LocalWorker`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ray.exceptions import RayActorError

log = logging.getLogger(__name__)


@dataclass
class LiveMoveConfig:
    copy_share: float = 0.02  # of the source's time a round's copies may take
    round_interval_s: float = 0.2  # rounds at least this far apart: their calls weigh little
    growth_tokens: int = 256  # tokens the target reserves beyond the stream's length
    final_blocks: int = 2  # go to the final stage once at most this many full blocks are left
    max_rounds: int = 10_000  # then the final stage whatever is left
    max_precopy_s: float = 120.0  # likewise
    call_timeout_s: float = 30.0  # one call to either worker


class Worker(Protocol):
    name: str

    async def call(self, method: str, *args: Any) -> Any: ...

    async def call2(self, method: str, *args: Any) -> tuple[dict[str, Any], Any]:
        """A two-return call: the meta (awaited) and the data (a reference to pass on)."""
        ...


class RayWorker:
    def __init__(self, handle: Any, name: str) -> None:
        self.handle, self.name = handle, name

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.handle, method).remote(*args)

    async def call2(self, method: str, *args: Any) -> tuple[dict[str, Any], Any]:
        meta_ref, data_ref = getattr(self.handle, method).remote(*args)
        return await meta_ref, data_ref


class LocalWorker:
    """An in-process worker body (tests, tools)."""

    def __init__(self, body: Any, name: str) -> None:
        self.body, self.name = body, name

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.body, method)(*args)

    async def call2(self, method: str, *args: Any) -> tuple[dict[str, Any], Any]:
        return await getattr(self.body, method)(*args)


class MoveFailed(Exception):
    def __init__(self, why: str, refused: bool = False, side: str = "",
                 snapshot: bool = False) -> None:
        super().__init__(why)
        self.refused = refused  # the target cannot take it (no room...): nothing changed
        self.side = side  # "source" or "target": which worker failed
        self.snapshot = snapshot  # the stream can still move by snapshot


@dataclass
class LiveResult:
    request_id: str
    stall_s: float = 0.0  # the final stage: the stream ran on neither worker
    bytes: int = 0
    rounds: int = 0
    precopy_s: float = 0.0


async def live_move(src: Worker, dst: Worker, dst_idx: int, request_id: str,
                    cfg: LiveMoveConfig) -> LiveResult:
    """Move `request_id` from `src` to `dst` live; raises MoveFailed (the stream then goes on
    at its source, or ended there) and leaves nothing reserved or frozen behind."""
    res = LiveResult(request_id)
    info = await _ok(src, "source", src.call("live_begin", request_id, dst.name), cfg)
    stage = "reserve"
    try:
        await _ok(dst, "target", dst.call("live_reserve", info, cfg.growth_tokens), cfg)
        stage = "rounds"
        t0 = time.monotonic()
        write: asyncio.Task | None = None
        while True:
            started = time.monotonic()
            meta, data = await _ok2(src, "source", src.call2("live_round", request_id,
                                                               cfg.copy_share), cfg)
            if write is not None:
                await write  # in order: the target checks where each round starts
                write = None
            res.rounds += 1
            if meta["blocks"]:
                res.bytes += _nbytes(meta)
                write = asyncio.ensure_future(
                    _ok(dst, "target", dst.call("live_write", request_id, meta, data), cfg))
            if (meta["left"] <= cfg.final_blocks or res.rounds >= cfg.max_rounds
                    or time.monotonic() - t0 > cfg.max_precopy_s):
                break
            await asyncio.sleep(max(0.0, cfg.round_interval_s - (time.monotonic() - started)))
        if write is not None:
            await write
        res.precopy_s = time.monotonic() - t0
        stage = "final"
        t1 = time.monotonic()
        meta, data = await _ok2(src, "source", src.call2("live_freeze", request_id), cfg)
        res.rounds += 1
        res.bytes += _nbytes(meta)
        stage = "commit"
        await _ok(dst, "target", dst.call("live_commit", request_id, meta, data), cfg)
        # from the stream's last step on its source (the step under way when the final stage
        # was asked for still ran there) to its commit on the target
        res.stall_s = max(0.0, time.monotonic() - t1 - float(meta.get("waited_s", 0.0)))
        stage = "done"
    except BaseException as e:
        await _undo(src, dst, request_id, stage, e)
        raise
    if not await src.call("live_finish", request_id, dst_idx):
        # the client left during the final stage: the target's copy has no consumer
        await _quiet(dst.call("abort", request_id))
        raise MoveFailed(f"request {request_id!r} was aborted during its move", side="source")
    return res


def _nbytes(meta: dict[str, Any]) -> int:
    shape = meta.get("shape")
    if not shape:
        return 0
    n = 1
    for d in shape:
        n *= d
    return n * {"float32": 4, "float16": 2, "bfloat16": 2}.get(meta.get("dtype", ""), 4)


async def _undo(src: Worker, dst: Worker, rid: str, stage: str, err: BaseException) -> None:
    """Call a failed move off on both sides (a dead worker's side went with it): the target
    frees its reservation, and a commit that may still land is aborted there (it has no
    consumer); the source keeps the stream, or takes it back from the final stage."""
    await _quiet(dst.call("live_cancel", rid))  # (a reserve that timed out may land later)
    if stage == "commit":
        await _quiet(dst.call("abort", rid))
    await _quiet(src.call("live_abandon", rid))
    log.warning("live move of %s from %s to %s failed at %s: %s", rid, src.name, dst.name,
                stage, err)


async def _quiet(call: Any) -> Any:
    try:
        return await asyncio.wait_for(call, 30.0)
    except Exception as e:  # the worker is gone: its side of the move went with it
        log.info("live move clean-up call failed: %s", e)
        return None


async def _ok(w: Worker, side: str, call: Any, cfg: LiveMoveConfig) -> Any:
    try:
        out = await asyncio.wait_for(call, cfg.call_timeout_s)
    except RayActorError as e:
        raise MoveFailed(f"{side} {w.name} died: {e}", side=side) from e
    except TimeoutError as e:
        raise MoveFailed(f"{side} {w.name} did not answer within {cfg.call_timeout_s} s",
                         side=side) from e
    if isinstance(out, dict) and "error" in out:
        raise MoveFailed(out["error"], refused=bool(out.get("refused")), side=side,
                         snapshot=bool(out.get("snapshot")))
    return out


async def _ok2(w: Worker, side: str, call: Any, cfg: LiveMoveConfig) -> tuple[dict, Any]:
    meta, data = await _ok(w, side, call, cfg)
    if "error" in meta:
        raise MoveFailed(meta["error"], refused=bool(meta.get("refused")), side=side,
                         snapshot=bool(meta.get("snapshot")))
    return meta, data
