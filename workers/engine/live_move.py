"""Live moves of running streams between engines: pre-copy rounds, then a short final stage.

The protocol (the router drives it, `router/mover.py`; every call here runs on an engine's
step thread, between steps):

1. **Reserve** on the target (`reserve`): device blocks for the stream as it is and its
   growth during the move, taken from the pool now (a reservation, owned by no stream). No
   room, another model or block size, a context too short: refused, nothing changes, and the
   stream stays where it is.
2. **Rounds** on the source (`Source.round`) while it keeps decoding: the full blocks written
   since the last round, at most a budget per round (`copy_share` of the time since the
   last round, at the copy rate the rounds measured: the copies take that share of the
   source's time, not more; the router spaces the rounds so that their fixed costs, a few
   calls each, weigh little), go to the target (`Target.write`), which copies them into its
   reserved blocks. Full blocks never change, so a round needs no pause.
3. **Final stage** once little is left (`Source.freeze`): the stream sits out the source's
   batch (its blocks stay referenced, `KVCacheManager.hold`), and the last full blocks, the
   partial tail and the request's state (tokens, sampling and RNG state, text and
   detokenizer position, grammar, logprobs) go over. The target writes them and **commits**
   (`Target.commit`): the reservation becomes a running stream, its full blocks published
   to the prefix cache, and it steps from the target's next step on.
4. Only then does the source free its blocks (`Source.release`). If the target refuses or
   fails at any point, the source takes the stream back (`Source.thaw`) and the target drops
   its reservation (`Target.cancel`); a reservation nobody touches for `LEASE_S` is freed by
   the target itself, so a router that dies mid-move strands nothing.

A stream that finishes, is aborted, or is parked by the source's scheduler during the rounds
ends the move (the router may fall back to a stop-and-copy move for a parked one).

A hand-off after prefill (disaggregated serving, router/handoff.py) is the final stage alone:
the target reserves before the prompt runs, the source holds the stream once its first token
is out (`Source.hold`) and reads all of it at once (`freeze`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.kvcache.hashing import hash_full_blocks
from kvserve.kvcache.kv_transport import KVTransport, transport_for
from kvserve.kvcache.manager import KVCacheFull, StreamState
from kvserve.workers.engine.sequence import Sequence, Status
from kvserve.workers.engine.snapshot import (
    model_geometry,
    record_adapter,
    sequence_from_record,
    stream_record,
)

if TYPE_CHECKING:
    from kvserve.workers.engine.adapters import Adapter
    from kvserve.workers.engine.engine import LLMEngine

LEASE_S = 60.0  # a reservation untouched this long is freed by its target
DEFAULT_COPY_SHARE = 0.02  # of the source's step time spent on a round's copies
DEFAULT_GROWTH_TOKENS = 256  # tokens a stream may grow by during its move (reserved ahead)
FIRST_ROUND_BLOCKS = 4  # the first round's size, before the copy rate is known


class MoveRefused(InvalidRequestError):
    """A live move that cannot start or go on; nothing changed on this engine. `snapshot`:
    the stream can still move by snapshot (stop-and-copy) instead."""

    def __init__(self, message: str, snapshot: bool = False) -> None:
        super().__init__(message)
        self.snapshot = snapshot


def transport(engine: LLMEngine) -> KVTransport | None:
    runner = engine.runner
    return transport_for(runner.cache, runner.host, runner.ranks is not None)


def _pack(t: torch.Tensor) -> np.ndarray:
    """A block-major KV tensor as flat bytes for Ray's object store (read zero-copy there)."""
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def _unpack(data: np.ndarray, shape: list[int], dtype: str) -> torch.Tensor:
    flat = torch.from_numpy(np.frombuffer(memoryview(data), dtype=np.uint8))  # read-only view
    return flat.view(getattr(torch, dtype)).view(shape)


def _dtype(engine: LLMEngine) -> str:
    return str(engine.runner.kv_dtype).removeprefix("torch.")


# ---- source ------------------------------------------------------------------------------------
@dataclass
class Source:
    """A stream being moved out of this engine."""

    request_id: str
    target: str  # the target worker (for logs)
    sent: int = 0  # leading full blocks already sent
    rounds: int = 0
    bytes_sent: int = 0
    frozen: StreamState | None = None  # set from the final stage on (the held stream)
    seq: Sequence | None = None
    final_hashes: list[int] = field(default_factory=list)  # of the blocks not sent, at hold
    read_s_per_block: float = 0.0  # moving average of the rounds' copy time per block
    last_round: float = 0.0  # when the last round ran (monotonic)

    def budget(self, share: float, now: float) -> int:
        """Blocks for the next round: the copies take `share` of the time since the last
        round (at least one block; a few to measure the copy rate on the first round)."""
        if self.read_s_per_block <= 0.0 or self.last_round <= 0.0:
            return FIRST_ROUND_BLOCKS
        return max(1, int(share * (now - self.last_round) / self.read_s_per_block))

    def observe(self, blocks: int, seconds: float) -> None:
        self.last_round = time.monotonic()
        if blocks:
            per = seconds / blocks
            self.read_s_per_block = per if self.read_s_per_block == 0.0 else (
                0.7 * self.read_s_per_block + 0.3 * per)

    @staticmethod
    def begin(engine: LLMEngine, request_id: str, target: str) -> tuple[Source, dict[str, Any]]:
        """Check the stream can move live; what the target needs to reserve."""
        seq = engine.seqs.get(request_id)
        if seq is None:
            raise MoveRefused(f"no unfinished request {request_id!r} here")
        kv = engine.kv
        if seq not in engine.scheduler.running or not kv.has_stream(request_id):
            raise MoveRefused(f"request {request_id!r} is not running here (waiting or parked): "
                              "it moves by snapshot", snapshot=True)
        if kv.stream(request_id).num_dropped:
            raise MoveRefused("a stream whose window released blocks moves by snapshot",
                              snapshot=True)
        if transport(engine) is None:
            raise MoveRefused("this tensor-parallel engine has no host tier to stage blocks",
                              snapshot=True)
        src = Source(request_id, target, seq=seq)
        return src, src.describe(engine)

    def describe(self, engine: LLMEngine) -> dict[str, Any]:
        seq = self.seq
        assert seq is not None
        return {"request_id": self.request_id, "tokens": engine.kv.num_computed(self.request_id),
                "max_len": seq.max_len, "block_size": engine.kv.block_size,
                "model": model_geometry(engine), "dtype": _dtype(engine),
                "bytes_per_block": engine.runner.bytes_per_block,
                "lora": seq.lora.record() if seq.lora is not None else None}

    def check(self, engine: LLMEngine) -> None:
        """Still movable: running here (not finished, aborted or parked meanwhile)."""
        seq = engine.seqs.get(self.request_id)
        if seq is None or seq is not self.seq or seq.status == Status.FINISHED:
            raise MoveRefused(f"request {self.request_id!r} finished or was aborted during "
                              "its move")
        if seq not in engine.scheduler.running or not engine.kv.has_stream(self.request_id):
            raise MoveRefused(f"request {self.request_id!r} was parked during its move",
                              snapshot=True)

    def round(self, engine: LLMEngine, max_blocks: int) -> tuple[dict[str, Any], np.ndarray]:
        """The next full blocks (at most `max_blocks`), with their hashes; `left` tells the
        router how many full blocks remain after them."""
        self.check(engine)
        state = engine.kv.stream(self.request_id)
        full = _written(engine, state) // engine.kv.block_size
        upto = min(full, self.sent + max(1, max_blocks))
        ids = state.block_ids[self.sent : upto]
        meta = {"first": self.sent, "blocks": len(ids),
                "hashes": _hashes(engine, self.seq, self.sent, upto),
                "left": full - upto, "tokens": state.num_computed}
        data = np.empty(0, dtype=np.uint8)
        if ids:
            t = transport(engine).read(ids)  # type: ignore[union-attr]
            meta.update(shape=list(t.shape), dtype=_dtype(engine))
            data = _pack(t)
        self.sent = upto
        self.rounds += 1
        self.bytes_sent += data.nbytes
        return meta, data

    def hold(self, engine: LLMEngine) -> None:
        """Take the stream out of the batch, its blocks kept (`KVCacheManager.hold`): it
        runs no further here until `freeze` sends it or `thaw` puts it back."""
        self.check(engine)
        seq = self.seq
        assert seq is not None
        bs = engine.kv.block_size
        self.final_hashes = _hashes(engine, seq, self.sent,
                                    engine.kv.num_computed(self.request_id) // bs)
        engine.scheduler.running.remove(seq)
        self.frozen = engine.kv.hold(self.request_id)

    def freeze(self, engine: LLMEngine) -> tuple[dict[str, Any], np.ndarray]:
        """The final stage: the stream leaves the batch (its blocks kept; or it was held
        already, a hand-off after prefill); the blocks not sent yet, its partial tail and its
        request state."""
        if self.frozen is None:
            self.hold(engine)
        elif (engine.seqs.get(self.request_id) is not self.seq
              or self.request_id not in engine.kv.held):
            raise MoveRefused(f"request {self.request_id!r} was aborted during its move")
        seq = self.seq
        assert seq is not None and self.frozen is not None
        move = transport(engine)
        assert move is not None  # (begin checked it)
        state = self.frozen
        try:
            n = state.num_computed
            ids = state.block_ids[self.sent : engine.kv.blocks_needed(n)]
            meta = {"first": self.sent, "blocks": len(ids), "tokens": n,
                    "hashes": self.final_hashes, "record": stream_record(engine, seq)}
            data = np.empty(0, dtype=np.uint8)
            if ids:
                t = move.read(ids)
                meta.update(shape=list(t.shape), dtype=_dtype(engine))
                data = _pack(t)
        except BaseException:
            self.thaw(engine)  # it runs on here, as if the final stage had not begun
            raise
        self.rounds += 1
        self.bytes_sent += data.nbytes
        return meta, data

    def thaw(self, engine: LLMEngine) -> bool:
        """The move failed after the final stage began: the stream runs here again."""
        if self.frozen is None:
            return False
        state, self.frozen = self.frozen, None
        seq = engine.seqs.get(self.request_id)
        if seq is None or self.request_id not in engine.kv.held:  # aborted meanwhile
            return False
        engine.kv.unhold(self.request_id, state)
        seq.handoff = False  # a hand-off that failed: it decodes here after all
        engine.scheduler.running.append(seq)
        if seq.lora is not None:
            engine.scheduler.regroup()
        return True

    def release(self, engine: LLMEngine) -> None:
        """The target committed: the stream leaves this engine, its blocks freed."""
        seq = engine.seqs.pop(self.request_id, None)
        if seq is not None:
            engine.scheduler.remove(seq)
        self.frozen = None


def _written(engine: LLMEngine, state: StreamState) -> int:
    """Tokens whose KV is written for certain: under asynchronous scheduling a launched step
    may still be writing from its start on."""
    if engine.step_in_flight and state.plan is not None:
        return min(state.num_computed, state.plan.start)
    return state.num_computed


def _hashes(engine: LLMEngine, seq: Sequence | None, first: int, upto: int) -> list[int]:
    """Chained hashes of the stream's full blocks first..upto (the prefix cache's, or made
    here when prefix caching is off)."""
    if upto <= first:
        return []
    assert seq is not None
    have = engine.kv.stream(seq.request_id).block_hashes if engine.kv.has_stream(
        seq.request_id) else []
    if len(have) >= upto:
        return have[first:upto]
    return hash_full_blocks(seq.all_ids[: upto * engine.kv.block_size], engine.kv.block_size,
                            parent=seq.kv_step.root)[first:upto]


# ---- target ------------------------------------------------------------------------------------
@dataclass
class Target:
    """A stream on its way into this engine: its reservation, and what has arrived."""

    request_id: str
    written: int = 0  # leading blocks written
    hashes: list[int] = field(default_factory=list)
    touched: float = field(default_factory=time.monotonic)
    bytes_in: int = 0
    lease_s: float = LEASE_S  # freed by this engine when untouched for this long
    # the stream's LoRA adapter here, held in host memory and in a device slot from the
    # reservation on (the stream runs at once when it commits)
    lora: Adapter | None = None

    @staticmethod
    def reserve(engine: LLMEngine, info: dict[str, Any],
                growth_tokens: int = DEFAULT_GROWTH_TOKENS, lease_s: float = LEASE_S) -> Target:
        """Reserve room for a stream described by the source's `begin` (or, for a hand-off
        after prefill, by the router before the prompt runs: `tokens` is then the prompt's
        length); MoveRefused when this engine cannot take it (nothing is then held)."""
        rid = info["request_id"]
        if info["model"] != model_geometry(engine):
            raise MoveRefused(f"the stream's model ({info['model']}) is not this engine's "
                              f"({model_geometry(engine)})")
        if info["block_size"] != engine.kv.block_size:
            raise MoveRefused(f"block size {info['block_size']} differs from this engine's "
                              f"{engine.kv.block_size}: the stream moves by snapshot",
                              snapshot=True)
        if transport(engine) is None:
            raise MoveRefused("this tensor-parallel engine has no host tier to stage blocks",
                              snapshot=True)
        if rid in engine.seqs or rid in engine.kv.reserved:
            raise MoveRefused(f"request id {rid!r} is in use here")
        tokens = int(info["tokens"])
        if info["max_len"] > engine.max_model_len:
            raise MoveRefused(f"the stream may grow to {info['max_len']} tokens; this engine's "
                              f"context is {engine.max_model_len}")
        sched = engine.scheduler
        if len(sched.running) >= sched.max_num_seqs:
            raise MoveRefused(f"no room: {len(sched.running)} streams run here "
                              f"(max_num_seqs {sched.max_num_seqs})")
        want = min(info["max_len"], engine.max_model_len, tokens + growth_tokens)
        n = engine.kv.blocks_needed(max(want, tokens + 1))
        ad = _hold_adapter(engine, info.get("lora"))
        try:
            engine.kv.reserve_blocks(rid, n)
        except KVCacheFull as e:
            _let_go(engine, ad)
            raise MoveRefused(f"no room for the stream: it needs {n} KV blocks, "
                              f"{e.free} are free here") from None
        return Target(rid, lease_s=lease_s, lora=ad)

    def touch(self) -> None:
        """The mover is still there (a hand-off whose prompt is still being prefilled)."""
        self.touched = time.monotonic()

    def _ensure(self, engine: LLMEngine, blocks: int) -> list[int]:
        have = engine.kv.reserved[self.request_id]
        if blocks > len(have):
            try:
                engine.kv.reserve_blocks(self.request_id, blocks - len(have))
            except KVCacheFull as e:
                raise MoveRefused(f"the stream outgrew its reservation and only {e.free} "
                                  "KV blocks are free here") from None
        return engine.kv.reserved[self.request_id]

    def write(self, engine: LLMEngine, meta: dict[str, Any], data: np.ndarray) -> None:
        """Copy a round's blocks into the reservation (in order, each block once)."""
        if self.request_id not in engine.kv.reserved:
            raise MoveRefused(f"no reservation for {self.request_id!r} here (it expired)")
        self.touched = time.monotonic()
        first, n = int(meta["first"]), int(meta["blocks"])
        if first != self.written:
            raise MoveRefused(f"round starts at block {first}, {self.written} are written")
        ids = self._ensure(engine, first + n)[first : first + n]
        if n:
            transport(engine).write(ids, _unpack(data, meta["shape"], meta["dtype"]))  # type: ignore[union-attr]
        self.written += n
        self.hashes.extend(meta["hashes"])
        self.bytes_in += int(data.nbytes)

    def commit(self, engine: LLMEngine, meta: dict[str, Any], data: np.ndarray) -> Sequence:
        """The final stage's blocks and state: the stream runs here from the next step."""
        self.write(engine, meta, data)
        r = meta["record"]
        seq = sequence_from_record(engine, r)
        tokens = int(meta["tokens"])
        if engine.kv.blocks_needed(tokens) != self.written:
            engine.discard(seq)
            raise MoveRefused(f"{self.written} blocks arrived for {tokens} tokens")
        engine.kv.adopt_reserved(self.request_id, tokens, self.hashes, seq.kv_step.root)
        if self.lora is not None:  # the reservation's slot is the stream's now
            assert seq.lora is self.lora and engine.adapters is not None
            seq.lora_slot = self.lora.slot
            engine.adapters.unpin(self.lora)  # the sequence holds its own pin
            self.lora = None
            engine.scheduler.regroup()
        seq.status = Status.RUNNING
        engine.seqs[self.request_id] = seq
        engine.scheduler.running.append(seq)
        return seq

    def cancel(self, engine: LLMEngine) -> None:
        engine.kv.release_reservation(self.request_id)
        _let_go(engine, self.lora)
        self.lora = None


def _hold_adapter(engine: LLMEngine, lora: dict[str, Any] | None) -> Adapter | None:
    """The arriving stream's adapter, in host memory and a device slot here (loaded here
    first if this engine does not have it); MoveRefused when it cannot be."""
    if lora is None:
        return None
    try:
        ad = record_adapter(engine, lora)
    except KVServeError as e:
        raise MoveRefused(f"the stream's LoRA adapter {lora['name']!r}: {e}") from None
    assert ad is not None and engine.adapters is not None
    engine.adapters.pin(ad)
    if engine.adapters.acquire(ad) < 0:
        engine.adapters.unpin(ad)
        raise MoveRefused(f"no LoRA slot free for adapter {ad.name!r}: every slot is held by "
                          "running streams of other adapters", snapshot=True)
    return ad


def _let_go(engine: LLMEngine, ad: Adapter | None) -> None:
    if ad is not None and engine.adapters is not None:
        engine.adapters.release(ad)
        engine.adapters.unpin(ad)
