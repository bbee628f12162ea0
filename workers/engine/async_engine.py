"""AsyncLLMEngine: an asyncio streaming front for LLMEngine, stepping on its own thread.

The step loop runs in a background thread, so the event loop never waits for a
forward pass. Requests and aborts reach the loop through thread-safe inboxes and
are applied between steps; each step's outputs go back to the callers' event
loops with call_soon_threadsafe. Cancelling (or abandoning) the consumer of
`generate` aborts the request and frees its KV blocks.

Stream moves run on the step thread too, between steps: `export_stream` takes a request
out (its consumer waits, in transit), then `hand_over` tells that consumer where it went
(StreamMoved) or `import_stream` of the same snapshot puts it back. An imported stream's
outputs wait for a consumer (`resume`); one nobody claims within CLAIM_TIMEOUT_S is aborted.

A hand-off request (disaggregated serving: prefilled here, decoded on another worker) is
held once its first token is out: it leaves the batch with its blocks kept, as in a live
move's final stage, and `handoff_wait` answers; the router then sends it with `live_freeze`
and the target's `live_commit`, and `live_finish` frees it here. A held stream nobody sends
within its lease fails and its blocks are freed.

`pause` holds the step loop between steps (requests, aborts, moves and stats are still taken;
nothing advances) until `unpause`; `step` runs one step meanwhile. Fault drills and tests use
it to hold a state (streams parked, a stream mid-generation) for as long as they need it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from kvserve.config import EngineConfig
from kvserve.errors import EngineDeadError, InvalidRequestError
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.workers.engine.engine import LLMEngine
from kvserve.workers.engine.live_move import LEASE_S, MoveRefused, Source, Target
from kvserve.workers.engine.migration import MoveCounters, ParkedTracker, StreamMoved
from kvserve.workers.engine.sequence import Sequence

log = logging.getLogger(__name__)

CLAIM_TIMEOUT_S = 60.0  # an imported stream nobody resumes by then is aborted
HANDOFF_ENDED_KEPT = 4096  # hand-off requests whose end a late `handoff_wait` still learns


class HandoffFailed(RuntimeError):
    """A prefilled stream could not be handed to its decode worker (the failure policy said
    to fail the request rather than recompute it there, or nobody came to send it)."""


@dataclass
class _Handoff:
    """A stream prefilled here for another worker."""

    lease_s: float = LEASE_S  # how long it may stay held, unsent
    held_at: float = 0.0  # when its first token was out and it left the batch (0: not yet)
    # its final stage (meta, blocks), read as it was held: the router's freeze takes it
    # without waiting for the step then under way (on a prefill worker, often the next
    # prompt's prefill)
    frozen: tuple[dict[str, Any], Any] | None = None


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.imported_at = 0.0  # set while an imported stream waits for its consumer

    def put(self, item: RequestOutput | BaseException) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the consumer's loop is closed
            return False


def _log_failed_release(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("releasing a handed-off stream failed: %s", fut.exception())


def _settle(fut: asyncio.Future, answer: Any) -> None:
    if not fut.done():
        fut.set_result(answer)


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for st, out in items:
        st.queue.put_nowait(out)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None,
                 on_dead: Callable[[EngineDeadError], None] | None = None) -> None:
        """`on_dead(error)` hears that the engine can never step again (a tensor-parallel
        rank died): every request then fails with that error, new ones at once."""
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.on_dead = on_dead
        self.dead: EngineDeadError | None = None
        self.tokenizer = self.engine.tokenizer
        self._adds: queue.SimpleQueue[tuple[Sequence, _Stream]] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._paused = False
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = \
            queue.SimpleQueue()
        self._moving: dict[str, _Stream] = {}  # exported, consumer waiting for the verdict
        self._unclaimed: dict[str, _Stream] = {}  # imported, no consumer yet
        self.moves = MoveCounters()
        # hand-offs after prefill: sent out (out), taken in (in), failed here, leases expired
        self.handoff_counts = {"out": 0, "in": 0, "failed": 0, "leases_expired": 0}
        self._parked = ParkedTracker()
        self._live_out: dict[str, Source] = {}  # live moves out of this engine
        self._live_in: dict[str, Target] = {}  # live moves into it (reservations)
        self._handoffs: dict[str, _Handoff] = {}  # prefilled here for another worker
        # answers owed to `handoff_wait` callers, by request id (the request may not be here yet)
        self._handoff_waits: dict[str, list[asyncio.Future]] = {}
        # how the latest hand-off requests ended without a hand-off (finished at their first
        # token, aborted, refused): a wait that comes after that learns it at once
        self._handoff_ended: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # every stream's state, tokens and blocks, rebuilt after a step once asked for
        self._view: list[dict[str, Any]] = []
        self._want_view = True
        self._stats: dict[str, Any] = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    # ---- public API ------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora: str | None = None,
        handoff: bool = False,
        lease_s: float = LEASE_S,
    ) -> AsyncIterator[RequestOutput]:
        """Yield incremental outputs (new tokens, text delta) until the request finishes.
        `lora`: a loaded LoRA adapter's name (None: the base model).

        `handoff`: prefill only; after the first token the stream is held for a hand-off to
        another worker (its consumer then ends with StreamMoved, or HandoffFailed when no
        hand-off came within `lease_s`). Bad input raises InvalidRequestError here (an
        unknown adapter NotFoundError), before
        anything is queued.
        """
        rid = request_id or uuid.uuid4().hex
        adapter = self.engine.resolve_lora(lora) if lora is not None else None
        if (params is not None and params.structured is not None) or (
                adapter is not None and adapter.weights is None):
            # a grammar's first compile can take a second, an adapter dropped from host
            # memory is read from disk: not on this event loop
            seq = await asyncio.to_thread(self.engine.make_sequence, prompt, params, rid, 0,
                                          adapter)
        else:
            seq = self.engine.make_sequence(prompt, params, rid, 0, adapter)
        if handoff:
            seq.handoff = True
            seq.handoff_lease_s = lease_s  # type: ignore[attr-defined]
        stream = _Stream(asyncio.get_running_loop())
        self._adds.put((seq, stream))
        self._wake.set()
        # closed with this generator, not when collected: a consumer that leaves has its
        # request aborted before its close returns
        async with aclosing(self._consume(stream, rid)) as outs:
            async for out in outs:
                yield out

    async def _consume(self, stream: _Stream, rid: str) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # StreamMoved included: the request lives on elsewhere
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    # ---- LoRA adapters ----------------------------------------------------------------------
    async def add_lora(self, name: str, source: str) -> dict[str, Any]:
        """Load a LoRA adapter (read and checked on a thread of its own; steps go on)."""
        return await asyncio.to_thread(self.engine.add_lora, name, source)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def list_loras(self) -> list[dict[str, Any]]:
        return self.engine.list_loras()

    # ---- stream moves (each runs on the step thread, between steps) ------------------------
    async def export_stream(self, request_id: str) -> bytes:
        """Take an unfinished request out as a snapshot; its consumer waits for the verdict
        (`hand_over`, or `import_stream` of this snapshot to take it back)."""
        return await self._call(lambda: self._export(request_id))

    async def import_stream(self, data: bytes) -> str:
        """Queue a snapshot's stream as parked here; returns its request id. A stream this
        engine exported gets its waiting consumer back; any other waits for `resume`."""
        loop = asyncio.get_running_loop()
        return await self._call(lambda: self._import(data, loop))

    async def hand_over(self, request_id: str, target: int) -> bool:
        """Tell an exported stream's consumer that it moved to worker `target`; False when
        that consumer is gone (the request was aborted in transit)."""
        return await self._call(lambda: self._hand_over(request_id, target))

    async def resume(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The outputs of an imported stream from where its previous engine stopped."""
        stream = await self._call(lambda: self._unclaimed.pop(request_id, None))
        if stream is None:
            raise InvalidRequestError(f"no imported stream {request_id!r} waits to be resumed")
        async with aclosing(self._consume(stream, request_id)) as outs:
            async for out in outs:
                yield out

    # ---- live moves (workers/engine/live_move.py; each call runs between steps) ----------
    async def live_begin(self, request_id: str, target: str) -> dict[str, Any]:
        """Start moving a running stream out live: what the target must reserve."""
        return await self._call(lambda: self._live_begin(request_id, target))

    async def live_round(self, request_id: str, copy_share: float,
                         max_blocks: int | None = None) -> tuple[dict[str, Any], Any]:
        """The next pre-copy round: (meta, block bytes). The round's copies take about
        `copy_share` of the time since the last round (at the copy rate measured so far)."""
        return await self._call(lambda: self._live_round(request_id, copy_share, max_blocks))

    async def live_freeze(self, request_id: str) -> tuple[dict[str, Any], Any]:
        """The final stage: the stream stops here; (meta with its state, the last blocks)."""
        asked = time.monotonic()
        return await self._call(lambda: self._live_freeze(request_id, asked))

    async def live_finish(self, request_id: str, target: int) -> bool:
        """The target committed: free the stream here; its consumer continues on `target`.
        False when the consumer left meanwhile (the target's copy must then be aborted).

        A hand-off's consumer is told at once (the stream is held: no step of this engine
        touches it) and its blocks are freed between steps, so the client's next token
        does not wait for the step under way here."""
        if request_id in self._handoffs:
            told = self._hand_over(request_id, target)  # (a pop: an abort's pop excludes it)
            freed = self._call(lambda: self._live_finish(request_id, target))
            freed.add_done_callback(_log_failed_release)
            return told
        return await self._call(lambda: self._live_finish(request_id, target))

    def take_frozen(self, request_id: str) -> tuple[dict[str, Any], Any] | None:
        """A held hand-off request's final stage, read as it was held (once); None when
        there is none (it was not read, or taken already)."""
        h = self._handoffs.get(request_id)
        if h is None or h.frozen is None:
            return None
        out, h.frozen = h.frozen, None
        return out

    async def live_abandon(self, request_id: str) -> bool:
        """The move failed: the stream goes on here (thawed if it was frozen)."""
        return await self._call(lambda: self._live_abandon(request_id))

    async def live_reserve(self, info: dict[str, Any], growth_tokens: int,
                           lease_s: float = LEASE_S) -> dict[str, Any]:
        """Reserve room for a stream on its way in (MoveRefused when there is none); freed
        here if nobody touches it for `lease_s`. Its LoRA adapter, if this engine lacks it
        or dropped it from host memory, is read first on a thread of its own, not on the
        step thread."""
        if info.get("lora"):
            try:
                await asyncio.to_thread(self._prepare_lora, info["lora"])
            except Exception as e:
                raise MoveRefused(f"the stream's LoRA adapter {info['lora']['name']!r}: {e}") from e
        return await self._call(lambda: self._live_reserve(info, growth_tokens, lease_s))

    def _prepare_lora(self, record: dict[str, Any]) -> None:
        """A moving stream's adapter here and in host memory (any thread)."""
        from kvserve.workers.engine.snapshot import record_adapter

        ad = record_adapter(self.engine, record)
        mgr = self.engine.adapters
        if ad is not None and mgr is not None and ad.weights is None:
            mgr.pin(ad)  # reads it back from disk here
            mgr.unpin(ad)

    async def live_write(self, request_id: str, meta: dict[str, Any], data: Any) -> int:
        """A pre-copy round's blocks into the reservation; the blocks written so far."""
        return await self._call(lambda: self._live_write(request_id, meta, data))

    async def live_commit(self, request_id: str, meta: dict[str, Any], data: Any) -> str:
        """The final stage: the stream runs here from the next step; its outputs wait for a
        consumer (`resume`), as an imported stream's do."""
        loop = asyncio.get_running_loop()
        return await self._call(lambda: self._live_commit(request_id, meta, data, loop))

    async def live_cancel(self, request_id: str) -> bool:
        """Drop a reservation (the move was called off)."""
        return await self._call(lambda: self._live_cancel(request_id))

    def live_moves(self) -> dict[str, Any]:
        return {"out": sorted(self._live_out), "in": sorted(self._live_in)}

    async def live_touch(self, request_id: str) -> bool:
        """Renew a reservation's lease (its stream is still being prefilled elsewhere)."""
        return await self._call(lambda: self._live_touch(request_id))

    # ---- hand-offs after prefill (disaggregated serving) -----------------------------------
    async def handoff_wait(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        """Wait until hand-off request `request_id` is held after its first token
        ({"held": True, "tokens": prompt tokens computed}), or ended without needing a
        hand-off ({"finished": True}: its first token ended it), or is gone ({"gone": why}:
        aborted, refused, failed; or it never came within `timeout_s`)."""
        loop = asyncio.get_running_loop()
        fut = await self._call(lambda: self._handoff_wait(request_id, loop))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            return {"gone": f"request {request_id!r} was not held for its hand-off within "
                            f"{timeout_s:g} s"}
        finally:
            if not fut.done():
                await self._call(lambda: self._forget_wait(request_id, fut))

    async def handoff_fail(self, request_id: str, why: str) -> bool:
        """End a held hand-off request with HandoffFailed(why), its blocks freed; False when
        it is not held here (finished, aborted or sent meanwhile)."""
        return await self._call(lambda: self._handoff_fail(request_id, why))

    def handoffs(self) -> dict[str, Any]:
        """Hand-off requests here: prefilling and held (request ids)."""
        return {"prefilling": sorted(r for r, h in self._handoffs.items() if not h.held_at),
                "held": sorted(r for r, h in self._handoffs.items() if h.held_at)}

    async def export_prefix(self, hashes: list[int]) -> bytes:
        """The leading blocks of `hashes` this engine's host tier caches (prefix_snapshot)."""
        from kvserve.workers.engine.prefix_snapshot import export_prefix

        return await self._call(lambda: export_prefix(self.engine, hashes))

    async def import_prefix(self, data: bytes) -> int:
        """Cache another engine's prefix blocks in this host tier; returns how many."""
        from kvserve.workers.engine.prefix_snapshot import import_prefix

        return await self._call(lambda: import_prefix(self.engine, data))

    def unfinished_ids(self) -> list[str]:
        """Requests with a consumer here (running, waiting or parked)."""
        return list(self._streams)

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)
        self._wake.set()

    @property
    def parked(self) -> list[dict[str, Any]]:
        """Parked streams, oldest first, their ages as of now (the router's view)."""
        return self._parked.streams()

    def streams(self) -> list[dict[str, Any]]:
        """Every stream here: request id, state (running, waiting, parked, moving), tokens,
        device KV blocks; as of the last step after the previous call (any thread)."""
        self._want_view = True
        return self._view

    def stats(self) -> dict[str, Any]:
        """The engine's counters as of the last step (read without stopping the loop)."""
        return {**self._stats, **self.moves.as_stats(),
                **{f"handoffs_{k}": v for k, v in self.handoff_counts.items()}}

    # ---- holding the step loop ---------------------------------------------------------------
    async def pause(self) -> None:
        """Stop stepping; returns once no step runs (one under way has completed). Requests,
        aborts, moves and stats are still served between steps; nothing advances until
        `step` or `unpause`."""
        self._paused = True
        await self._call(lambda: None)  # answered between steps, after the flag is seen

    async def step(self) -> int:
        """Run one step of a paused engine; returns how many outputs it made (0: nothing
        to run)."""
        return await self._call(self._step_now)

    def unpause(self) -> None:
        self._paused = False
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._paused

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.close()

    # ---- the step loop (engine thread) ------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            self._drain()
            if self._paused or not eng.has_unfinished():
                self._refresh()
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except EngineDeadError as e:
                self._died(e)
                continue
            except Exception as e:  # keep serving: fail what was running, not the engine
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self._deliver(outs)
            self._refresh()
        self._fail_all(RuntimeError("engine shut down"))

    def _step_now(self) -> int:
        if not self.engine.has_unfinished():
            return 0
        try:
            outs = self.engine.step()
        except EngineDeadError as e:
            self._died(e)
            raise
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(e)
            raise
        self._deliver(outs)
        self._refresh()
        return len(outs)

    def _died(self, err: EngineDeadError) -> None:
        log.error("engine is dead: %s", err)
        self.dead = err
        if self.on_dead is not None:  # first: a worker process may end here, its streams with it
            self.on_dead(err)
        self._fail_all(err)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their consumers: one callback per event loop, so that
        every stream of the step wakes in the same pass of its loop (the worker batches
        them into one Ray item)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outs:
            st = self._streams.get(out.request_id)
            if st is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(st.loop, []).append((st, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the consumers' loop is closed
                for _st, out in items:
                    if not out.finished:
                        self.engine.abort(out.request_id)
                        self._streams.pop(out.request_id, None)
        if self._handoffs:  # after the first token went out: held for their hand-off
            self._hold_handoffs(outs)

    def _refresh(self) -> None:
        self._stats = self.engine.stats()
        self._parked.view(self.engine)
        if self._want_view:
            self._want_view = False
            self._view = self._build_view()

    def _build_view(self) -> list[dict[str, Any]]:
        eng = self.engine
        kv, sched = eng.kv, eng.scheduler
        out = []
        for name, seqs in (("running", sched.running), ("waiting", sched.waiting),
                           ("parked", sched.parked)):
            for s in seqs:
                st = kv.streams.get(s.request_id)
                out.append({"request_id": s.request_id,
                            "state": "moving" if s.request_id in self._live_out else name,
                            "tokens": len(s.all_ids),
                            "blocks": len(st.live_blocks) if st is not None else 0})
        for rid, src in self._live_out.items():
            if src.frozen is not None and src.seq is not None:  # in its final stage
                out.append({"request_id": rid, "state": "moving",
                            "tokens": len(src.seq.all_ids), "blocks": len(src.frozen.live_blocks)})
        return out

    def _drain(self) -> None:
        eng = self.engine
        while True:
            try:
                seq, st = self._adds.get_nowait()
            except queue.Empty:
                break
            if self.dead is not None:  # nothing will step it
                eng.discard(seq)
                st.put(self.dead)
                continue
            try:
                eng.add_sequence(seq)
            except Exception as e:
                st.put(e)
                if seq.handoff:
                    self._resolve_waits(seq.request_id, {"gone": str(e)})
                continue
            self._streams[seq.request_id] = st
            if seq.handoff:
                self._handoff_ended.pop(seq.request_id, None)
                self._handoffs[seq.request_id] = _Handoff(
                    getattr(seq, "handoff_lease_s", LEASE_S))
        # after the adds: a request cancelled right after it was queued is dropped here
        self._apply_aborts()
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                break
            # an abort queued before this call goes first: an abort of a request id followed
            # by an import under that id (a failed hand-off recomputed on the same worker)
            # must not end the imported stream
            self._apply_aborts()
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)
        now = time.monotonic()
        for rid, tgt in list(self._live_in.items()):
            if now - tgt.touched > tgt.lease_s:  # its mover is gone: nothing stays stranded
                log.warning("live move of %s into this engine was abandoned; freeing its "
                            "reservation", rid)
                tgt.cancel(eng)
                del self._live_in[rid]
        for rid, h in list(self._handoffs.items()):
            if h.held_at and now - h.held_at > h.lease_s:  # nobody came to send it
                log.warning("hand-off of %s was not sent within %g s; failing it", rid, h.lease_s)
                self.handoff_counts["leases_expired"] += 1  # (before its consumer hears)
                self._handoff_fail(rid, f"the hand-off of request {rid!r} to its decode "
                                        f"worker did not come within {h.lease_s:g} s")
        for rid, st in list(self._unclaimed.items()):
            if now - st.imported_at > CLAIM_TIMEOUT_S:
                log.warning("imported stream %s was never resumed; aborting it", rid)
                eng.abort(rid)
                self._streams.pop(rid, None)
                del self._unclaimed[rid]

    def _apply_aborts(self) -> None:
        eng = self.engine
        while True:
            try:
                rid = self._aborts.get_nowait()
            except queue.Empty:
                return
            eng.abort(rid)
            self._streams.pop(rid, None)
            self._moving.pop(rid, None)
            self._unclaimed.pop(rid, None)
            self._live_out.pop(rid, None)
            if self._handoffs.pop(rid, None) is not None:
                self._resolve_waits(rid, {"gone": f"request {rid!r} was aborted"})

    def _call(self, fn: Callable[[], Any]) -> asyncio.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        self._wake.set()
        return asyncio.wrap_future(fut)

    def _export(self, rid: str) -> bytes:
        if rid in self._unclaimed:  # its consumer is still on the way from the last move
            raise InvalidRequestError(f"request {rid!r} has not been resumed here yet")
        # asynchronous scheduling: the tokens in flight reach their consumers before the move
        self._deliver(self.engine.flush())
        data = self.engine.export_stream(rid)
        st = self._streams.pop(rid, None)
        if st is not None:
            self._moving[rid] = st
        self.moves.moved_out += 1
        self.moves.snapshot_bytes_out += len(data)
        self._refresh()  # a load answered next shows it gone, even before the next step
        return data

    def _import(self, data: bytes, loop: asyncio.AbstractEventLoop) -> str:
        try:
            rid = self.engine.import_stream(data)
        except Exception:
            self.moves.import_failures += 1
            raise
        st = self._moving.pop(rid, None)
        if st is not None:  # a move of ours that failed: the stream is back, same consumer
            self.moves.moved_out -= 1
            self.moves.snapshot_bytes_out -= len(data)
            self.moves.returned += 1
        else:
            st = _Stream(loop)
            st.imported_at = time.monotonic()
            self._unclaimed[rid] = st
            self.moves.moved_in += 1
            self.moves.snapshot_bytes_in += len(data)
        self._streams[rid] = st
        self._refresh()  # a load answered next shows it parked here, even before a step
        return rid

    def _live_begin(self, rid: str, target: str) -> dict[str, Any]:
        if rid in self._live_out:
            raise MoveRefused(f"request {rid!r} is already moving")
        if rid not in self._streams:
            raise MoveRefused(f"request {rid!r} has no consumer here")
        src, info = Source.begin(self.engine, rid, target)
        self._live_out[rid] = src
        return info

    def _source(self, rid: str) -> Source:
        src = self._live_out.get(rid)
        if src is None:
            raise MoveRefused(f"request {rid!r} is not moving out of this engine (finished or "
                              "aborted)")
        return src

    def _live_round(self, rid: str, share: float, max_blocks: int | None) -> tuple[dict, Any]:
        src = self._source(rid)
        if max_blocks is None:
            max_blocks = src.budget(share, time.monotonic())
        t0 = time.perf_counter()
        try:
            meta, data = src.round(self.engine, max_blocks)
        except MoveRefused:
            self._live_out.pop(rid, None)
            raise
        src.observe(meta["blocks"], time.perf_counter() - t0)
        return meta, data

    def _live_freeze(self, rid: str, asked: float) -> tuple[dict, Any]:
        waited = time.monotonic() - asked  # the step under way when it was asked for ran on
        src = self._source(rid)
        # asynchronous scheduling: the stream's tokens in flight go to its consumer first
        self._deliver(self.engine.flush())
        try:
            meta, data = src.freeze(self.engine)
        except MoveRefused:
            self._live_out.pop(rid, None)
            raise
        st = self._streams.pop(rid, None)
        if st is not None:  # waits for the verdict, as an exported stream's consumer
            self._moving[rid] = st
        self._refresh()
        meta["waited_s"] = waited
        return meta, data

    def _live_finish(self, rid: str, target: int) -> bool:
        src = self._live_out.pop(rid, None)
        if self._handoffs.pop(rid, None) is not None:
            self.handoff_counts["out"] += 1
            if src is not None:
                src.release(self.engine)
        elif src is not None:
            src.release(self.engine)
            self.moves.moved_out += 1
            self.moves.snapshot_bytes_out += src.bytes_sent
        self._refresh()
        return self._hand_over(rid, target)

    def _live_abandon(self, rid: str) -> bool:
        src = self._live_out.pop(rid, None)
        if src is None:
            return False
        thawed = src.thaw(self.engine)
        if self._handoffs.pop(rid, None) is not None:  # a failed hand-off decodes here
            seq = self.engine.seqs.get(rid)
            # (a final stage that failed midway thawed the stream itself)
            thawed = thawed or (seq is not None and seq in self.engine.scheduler.running)
        st = self._moving.pop(rid, None)
        if st is not None:
            if thawed:
                self._streams[rid] = st  # the same consumer reads on
            else:  # aborted while frozen
                st.put(RuntimeError(f"request {rid!r} was aborted during its move"))
        self._refresh()
        return thawed

    def _live_reserve(self, info: dict[str, Any], growth_tokens: int,
                      lease_s: float) -> dict[str, Any]:
        rid = info["request_id"]
        if rid in self._streams or rid in self._unclaimed or rid in self._live_in:
            raise MoveRefused(f"request id {rid!r} is in use here")
        self._live_in[rid] = tgt = Target.reserve(self.engine, info, growth_tokens, lease_s)
        tgt.handoff = bool(info.get("handoff"))  # type: ignore[attr-defined]
        self._refresh()
        return {"blocks": len(self.engine.kv.reserved.get(rid, []))}

    def _target(self, rid: str) -> Target:
        tgt = self._live_in.get(rid)
        if tgt is None:
            raise MoveRefused(f"no reservation for {rid!r} here (cancelled or expired)")
        return tgt

    def _live_write(self, rid: str, meta: dict[str, Any], data: Any) -> int:
        tgt = self._target(rid)
        tgt.write(self.engine, meta, data)
        return tgt.written

    def _live_commit(self, rid: str, meta: dict[str, Any], data: Any,
                     loop: asyncio.AbstractEventLoop) -> str:
        tgt = self._target(rid)
        try:
            tgt.commit(self.engine, meta, data)
        except BaseException:
            self._live_in.pop(rid, None)
            tgt.cancel(self.engine)
            raise
        del self._live_in[rid]
        st = _Stream(loop)
        st.imported_at = time.monotonic()
        self._unclaimed[rid] = st
        self._streams[rid] = st
        if getattr(tgt, "handoff", False):
            self.handoff_counts["in"] += 1
        else:
            self.moves.moved_in += 1
            self.moves.snapshot_bytes_in += tgt.bytes_in
        self._refresh()
        return rid

    def _live_touch(self, rid: str) -> bool:
        tgt = self._live_in.get(rid)
        if tgt is None:
            return False
        tgt.touch()
        return True

    # ---- hand-offs (step thread) ----------------------------------------------------------
    def _hold_handoffs(self, outs: list[RequestOutput]) -> None:
        """Hand-off requests whose first token just went out leave the batch (held, their
        blocks kept) and wait to be sent; one that ended with that token needs no hand-off."""
        for out in outs:
            rid = out.request_id
            h = self._handoffs.get(rid)
            if h is None or h.held_at:
                continue
            if out.finished:
                del self._handoffs[rid]
                self._resolve_waits(rid, {"finished": True})
                continue
            seq = self.engine.seqs.get(rid)
            if seq is None:  # aborted meanwhile
                del self._handoffs[rid]
                self._resolve_waits(rid, {"gone": f"request {rid!r} was aborted"})
                continue
            src = Source(rid, "handoff", seq=seq)
            try:
                src.hold(self.engine)
            except MoveRefused as e:  # parked by its own engine meanwhile: it decodes here
                log.warning("hand-off request %s cannot be held (%s); it decodes here", rid, e)
                seq.handoff = False
                del self._handoffs[rid]
                self._resolve_waits(rid, {"gone": str(e)})
                continue
            t0 = time.perf_counter()
            try:  # the final stage now, between steps: the freeze need not wait for one
                meta, data = src.freeze(self.engine)
            except Exception as e:  # (thawed: it decodes here)
                log.warning("hand-off request %s cannot be frozen (%s); it decodes here", rid, e)
                del self._handoffs[rid]
                self._resolve_waits(rid, {"gone": str(e)})
                continue
            meta["freeze_s"], meta["waited_s"] = time.perf_counter() - t0, 0.0
            h.frozen = (meta, data)
            h.held_at = time.monotonic()
            self._live_out[rid] = src
            st = self._streams.pop(rid, None)
            if st is not None:  # waits for the verdict, as a moving stream's consumer does
                self._moving[rid] = st
            self._resolve_waits(rid, {"held": True, "tokens": src.frozen.num_computed
                                      if src.frozen is not None else 0})

    def _handoff_wait(self, rid: str, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        fut = loop.create_future()
        h = self._handoffs.get(rid)
        src = self._live_out.get(rid)
        if h is not None and h.held_at and src is not None and src.frozen is not None:
            fut.set_result({"held": True, "tokens": src.frozen.num_computed})
        elif h is None and rid in self._handoff_ended:  # it ended before this wait came
            fut.set_result(self._handoff_ended[rid])
        elif h is None and rid in self._streams:  # here, but not for a hand-off
            fut.set_result({"gone": f"request {rid!r} is not a hand-off request here"})
        else:  # prefilling, or not arrived yet
            self._handoff_waits.setdefault(rid, []).append(fut)
        return fut

    def _forget_wait(self, rid: str, fut: asyncio.Future) -> None:
        waits = self._handoff_waits.get(rid, [])
        if fut in waits:
            waits.remove(fut)
        if not waits:
            self._handoff_waits.pop(rid, None)

    def _resolve_waits(self, rid: str, answer: dict[str, Any]) -> None:
        if not answer.get("held"):
            self._handoff_ended[rid] = answer
            self._handoff_ended.move_to_end(rid)
            while len(self._handoff_ended) > HANDOFF_ENDED_KEPT:
                self._handoff_ended.popitem(last=False)
        for fut in self._handoff_waits.pop(rid, []):
            try:
                fut.get_loop().call_soon_threadsafe(_settle, fut, answer)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _handoff_fail(self, rid: str, why: str) -> bool:
        h = self._handoffs.pop(rid, None)
        src = self._live_out.pop(rid, None)
        if h is None or src is None:
            if h is not None:
                self._resolve_waits(rid, {"gone": why})
            return False
        self.engine.abort(rid)  # frees the held blocks
        self.handoff_counts["failed"] += 1
        st = self._moving.pop(rid, None) or self._streams.pop(rid, None)
        if st is not None:
            st.put(HandoffFailed(why))
        self._resolve_waits(rid, {"gone": why})
        self._refresh()
        return True

    def _live_cancel(self, rid: str) -> bool:
        tgt = self._live_in.pop(rid, None)
        if tgt is None:
            return False
        tgt.cancel(self.engine)
        self._refresh()
        return True

    def _hand_over(self, rid: str, target: int) -> bool:
        st = self._moving.pop(rid, None)
        if st is None:
            return False
        return st.put(StreamMoved(rid, target))

    def _fail_all(self, err: BaseException) -> None:
        for rid, st in [*self._streams.items(), *self._moving.items()]:
            self.engine.abort(rid)
            st.put(err)
        self._streams.clear()
        self._moving.clear()
        self._unclaimed.clear()
        self._live_out.clear()
        for rid in list(self._handoffs) + list(self._handoff_waits):
            self._resolve_waits(rid, {"gone": f"the engine failed: {err}"})
        self._handoffs.clear()
        for tgt in self._live_in.values():
            tgt.cancel(self.engine)
        self._live_in.clear()
        while True:  # nobody will run these any more
            try:
                _fn, fut = self._calls.get_nowait()
            except queue.Empty:
                break
            fut.set_exception(RuntimeError("engine shut down"))
