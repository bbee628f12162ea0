"""One hand-off of a prefilled stream to its decode worker (disaggregated serving), driven
from the router with the workers' live-move calls (workers/engine/live_move.py), final stage
only: the decode worker reserved room before the prompt ran (`reserve`), the prefill worker
holds the stream once its first token is out, then freeze -> commit -> release, the KV
passing from object store to object store as a live move's rounds do.

A hand-off that fails after the freeze is recomputed on a decode worker (the stream's state
without its KV, imported there as a snapshot: it recomputes the prompt and goes on) or fails
the request, by the failure policy. Reservations are freed on commit, on failure, and by
their worker when nobody renews their lease (`lease_s`), so a router that dies strands
nothing; so are the prefill worker's held blocks (its own lease).

`Worker` adapters are router/live_move.py's: `RayWorker` over an actor handle, `LocalWorker`
over an in-process worker body (tests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError

from kvserve.router.live_move import MoveFailed, Worker, _nbytes, _ok, _quiet
from kvserve.workers.engine.snapshot import snapshot_without_kv

log = logging.getLogger(__name__)

FAILURE_POLICIES = ("recompute", "fail")
# what became of a hand-off: moved (its KV copied), recomputed (on a decode worker, the copy
# having failed), failed (the request failed), kept (it decodes on its prefill worker: the
# freeze failed there), finished (its first token ended it: nothing to hand over), gone
# (aborted, its prefill worker died, or it never came)
OUTCOMES = ("moved", "recomputed", "failed", "kept", "finished", "gone")


@dataclass
class HandoffConfig:
    lease_s: float = 60.0  # reservations and held streams are freed when untouched this long
    call_timeout_s: float = 30.0  # one call to either worker
    growth_tokens: int = 256  # the decode worker reserves this much beyond the prompt
    failure_policy: str = "recompute"


@dataclass
class HandoffResult:
    request_id: str
    outcome: str
    seconds: float = 0.0  # the stream ran on neither worker: freeze, copy, commit, release
    bytes: int = 0
    tokens: int = 0  # the prompt tokens whose KV was handed over
    dst: int = -1  # where it decodes (a recompute may take it to another decode worker)
    error: str = ""


def reservation(request_id: str, prompt_tokens: int, max_len: int,
                kv: dict[str, Any]) -> dict[str, Any]:
    """What a decode worker reserves for a stream before its prompt runs elsewhere (a live
    move's `Source.describe`, from the prefill worker's KV description, `WorkerActor.info`)."""
    return {"request_id": request_id, "tokens": prompt_tokens, "max_len": max_len,
            "block_size": kv["block_size"], "model": kv["model"], "dtype": kv["dtype"],
            "bytes_per_block": 0, "handoff": True}


async def reserve(dst: Worker, info: dict[str, Any], cfg: HandoffConfig) -> int:
    """Reserve room on the decode worker; its blocks. Raises MoveFailed (refused: no room)."""
    res = await _ok(dst, "target", dst.call("live_reserve", info, cfg.growth_tokens,
                                            cfg.lease_s), _timeouts(cfg))
    return int(res.get("blocks", 0))


async def hand_off(src: Worker, dst: Worker, dst_idx: int, request_id: str, cfg: HandoffConfig,
                   recompute_on: list[tuple[Worker, int]] | None = None) -> HandoffResult:
    """Wait for `request_id`'s prefill on `src` (renewing `dst`'s reservation meanwhile),
    then hand it to `dst`. `recompute_on`: decode workers to recompute it on when the copy
    fails (the policy allowing); `dst` first by default. Never raises for the stream's sake:
    the outcome says what happened, and nothing stays reserved or held."""
    rid = request_id
    try:
        meta, data = await _prefilled(src, dst, rid, cfg)
    except asyncio.CancelledError:  # a retry of the request replaces this hand-off
        await _quiet(dst.call("live_cancel", rid))
        raise
    except Exception as e:  # the prefill worker died: the ingress retries the request
        await _quiet(dst.call("live_cancel", rid))
        return HandoffResult(rid, "gone", error=f"prefill worker {src.name}: {e}")
    if "finished" in meta or "gone" in meta:
        await _quiet(dst.call("live_cancel", rid))
        outcome = "finished" if meta.get("finished") else "gone"
        return HandoffResult(rid, outcome, error=str(meta.get("gone", "")))
    if "error" in meta:  # the freeze failed on the prefill worker
        await _quiet(dst.call("live_cancel", rid))
        if meta.get("refused"):  # aborted (the client left) while held: nothing to hand over
            return HandoffResult(rid, "gone", error=meta["error"])
        return await _not_copied(src, rid, meta["error"], cfg)
    t0 = time.monotonic()
    nbytes = _nbytes(meta)
    try:
        await _ok(dst, "target", dst.call("live_commit", rid, meta, data), _timeouts(cfg))
    except MoveFailed as e:
        await _quiet(dst.call("live_cancel", rid))
        await _quiet(dst.call("abort", rid))  # a commit that lands late has no consumer
        log.warning("hand-off of %s from %s to %s failed at commit: %s", rid, src.name,
                    dst.name, e)
        return await _failed(src, rid, meta, str(e), cfg,
                             recompute_on if recompute_on is not None else [(dst, dst_idx)])
    if not await _finish(src, rid, dst_idx, cfg):
        await _quiet(dst.call("abort", rid))  # the client left while it was handed over
        return HandoffResult(rid, "gone", error="the request was aborted during its hand-off")
    return HandoffResult(rid, "moved", time.monotonic() - t0 + float(meta.get("freeze_s", 0.0)),
                         nbytes, int(meta.get("tokens", 0)), dst_idx)


async def _prefilled(src: Worker, dst: Worker, rid: str,
                     cfg: HandoffConfig) -> tuple[dict[str, Any], Any]:
    """The prefill worker's answer once the prompt ran (its final stage, or why there is
    none), the decode worker's reservation renewed while it runs."""
    freeze = asyncio.ensure_future(src.call2("handoff_freeze", rid, cfg.lease_s))
    try:
        while True:
            done, _ = await asyncio.wait({freeze}, timeout=max(0.1, cfg.lease_s / 3))
            if done:
                return freeze.result()
            await _quiet(dst.call("live_touch", rid))
    finally:
        if not freeze.done():
            freeze.cancel()


async def _finish(src: Worker, rid: str, dst_idx: int, cfg: HandoffConfig) -> bool:
    """The prefill worker frees the stream; its consumer continues on `dst_idx`. False when
    the consumer left (or the prefill worker died: its client's stream went with it)."""
    try:
        return bool(await asyncio.wait_for(src.call("live_finish", rid, dst_idx),
                                           cfg.call_timeout_s))
    except (RayActorError, TimeoutError) as e:
        log.warning("hand-off of %s: its prefill worker did not release it: %s", rid, e)
        return False


async def _failed(src: Worker, rid: str, meta: dict[str, Any], why: str, cfg: HandoffConfig,
                  targets: list[tuple[Worker, int]]) -> HandoffResult:
    """The copy failed: recompute the stream on a decode worker (its state without KV, as a
    snapshot), or fail the request, by the policy."""
    if cfg.failure_policy == "recompute":
        snap = snapshot_without_kv(meta["record"])
        for w, idx in targets:
            try:
                res = await asyncio.wait_for(w.call("import_stream", snap), cfg.call_timeout_s)
            except Exception as e:  # dead or stuck: the next one
                log.warning("recomputing %s on %s failed: %s", rid, w.name, e)
                continue
            if "error" in res:
                log.warning("recomputing %s on %s refused: %s", rid, w.name, res["error"])
                continue
            if not await _finish(src, rid, idx, cfg):
                await _quiet(w.call("abort", rid))
                return HandoffResult(rid, "gone", error="aborted during its hand-off")
            return HandoffResult(rid, "recomputed", tokens=int(meta.get("tokens", 0)), dst=idx,
                                 error=why)
        why = f"{why}; recomputing it on a decode worker failed too"
    await _quiet(src.call("handoff_fail", rid, f"the hand-off to a decode worker failed: {why}"))
    return HandoffResult(rid, "failed", error=why)


async def _not_copied(src: Worker, rid: str, why: str, cfg: HandoffConfig) -> HandoffResult:
    """The freeze failed on the prefill worker (the stream was put back in its batch there):
    under `recompute` it decodes there, under `fail` the request fails."""
    if cfg.failure_policy == "recompute" and await _quiet(src.call("live_abandon", rid)):
        return HandoffResult(rid, "kept", error=why)
    await _quiet(src.call("handoff_fail", rid, f"the hand-off to a decode worker failed: {why}"))
    return HandoffResult(rid, "failed", error=why)


def _timeouts(cfg: HandoffConfig) -> Any:
    from kvserve.router.live_move import LiveMoveConfig

    return LiveMoveConfig(call_timeout_s=cfg.call_timeout_s)
