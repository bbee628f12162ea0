"""Per-stream block tables over a shared block pool, with plan-then-apply steps.

Every stream (one sequence) owns a block table and attends only to its own
KV. A step is planned first: `reserve` checks that every block the step will
write fits, and only then takes them and advances the streams to the step's
targets; if they do not fit it raises `KVCacheFull` and nothing has changed.
After the forward pass succeeds, `commit` publishes newly full blocks to the
prefix cache; if the forward raised, `rollback` returns the reserved blocks and
puts the streams back where they were.
Writes only ever touch a stream's private tail blocks (shared blocks are full
and immutable), so a failed step cannot corrupt another stream's KV.

With a host tier attached, a new stream's prefix is looked up on the device
first, then on host (served by copy into newly reserved blocks); device blocks
whose cached content the allocator drops are listed in the plan so the runner
can demote them to host before the forward overwrites them.

The block tables also live in one persistent array (`block_tables.py`), a row per
stream, written only where a step took blocks; steps read their rows from it.

When every layer of the model attends through a sliding window (`window`), `commit`
releases a stream's leading blocks once no future query can reach them: the table (and its
row) keeps their (stale) ids so positions still index it, and `StreamState.num_dropped` says
how many lead it. Full dropped blocks stay in the prefix cache until the allocator reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.block_tables import BlockTables
from kvserve.kvcache.hashing import ROOT_HASH, hash_block

if TYPE_CHECKING:
    from kvserve.kvcache.host_cache import HostTier, ParkedKV


class KVCacheFull(Exception):
    """The planned step needs more free blocks than the pool has; nothing was changed."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"step needs {needed} free KV blocks, {free} available")
        self.needed = needed
        self.free = free


@dataclass
class StreamState:
    block_ids: list[int] = field(default_factory=list)
    # tokens whose KV is written and valid, or whose writing the reserved step queued
    num_computed: int = 0
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    num_cached_prompt: int = 0  # tokens served from the prefix cache on admission
    slot: int = -1  # the stream's row in the persistent block-table array
    plan: PlannedStream | None = None  # its part of the last plan, reused by the next one
    num_dropped: int = 0  # leading blocks released: outside every layer's window
    root: int = ROOT_HASH  # its hash chain's root: its LoRA adapter's (`StreamStep.root`)

    @property
    def live_blocks(self) -> list[int]:
        """The blocks the stream still holds (its table without the dropped lead)."""
        return self.block_ids[self.num_dropped :] if self.num_dropped else self.block_ids


@dataclass
class StreamStep:
    """One stream's part of a step: compute KV up to position `target` (exclusive)."""

    stream_id: str
    token_ids: list[int]  # every token known for the stream so far
    target: int
    resume: ParkedKV | None = None  # a parked stream coming back: its host tail is usable
    pending: int = 0  # sampled tokens past `token_ids` still on the device (async scheduling)
    use_host: bool = True  # False: what the host holds is recomputed (cheaper than a copy)
    # proposed tokens past `token_ids` (speculative decoding): the step computes their KV and
    # their logits too; `accept_drafts` keeps the accepted ones after the step
    draft: list[int] = field(default_factory=list)
    # the root of the stream's block hash chain: 0 for the base model, its LoRA adapter's
    # otherwise, so KV computed under one adapter is never shared with another or the base
    root: int = ROOT_HASH


@dataclass
class PrefixHit:
    """Where a new stream's known KV lives: device blocks, then host blocks, then a host tail."""

    device_blocks: list[int]
    host_blocks: list[int]
    tail_block: int | None
    num_tokens: int  # tokens covered by all three


@dataclass(slots=True)
class PlannedStream:
    stream_id: str
    start: int  # first position computed in this step
    target: int  # num_computed after the step
    block_ids: list[int]  # the stream's full block table after reservation
    new_blocks: list[int]  # blocks taken for this step (returned on rollback)
    cached_blocks: list[int]  # prefix-cache blocks referenced for a new stream
    is_new: bool
    num_new_blocks: int = 0
    host_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) to copy in
    host_tokens: int = 0  # tokens of `start` served from host by copy
    slot: int = -1  # row of `block_ids` in the persistent block-table array
    state: StreamState | None = None  # the stream's state (set once reserved)
    drafts: int = 0  # positions at the end of the step that hold proposed tokens
    root: int = ROOT_HASH  # a new stream's hash-chain root (its adapter's)


@dataclass
class StepPlan:
    streams: list[PlannedStream]
    token_ids: dict[str, list[int]]
    demoted: list[tuple[int, int]] = field(default_factory=list)  # (device block, hash) reused
    tables: BlockTables | None = None  # every stream's row, `slot` of each planned stream
    restores: list[PlannedStream] = field(default_factory=list)  # new streams with host_in
    num_tokens: int = 0  # tokens the step computes (sum of target - start)
    publish: list[PlannedStream] = field(default_factory=list)  # streams that fill a block
    num_drafts: int = 0  # proposed tokens among `num_tokens` (speculative decoding)


# The empty new_blocks/cached_blocks/host_in of a running stream's plan (never mutated: rollback and
# _unpin only read or replace them), so a decode step allocates no lists for them.
_NONE: list[int] = []
_NO_PAIRS: list[tuple[int, int]] = []


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, max_blocks_per_stream: int | None = None,
                 slots: int = 16, pin_tables: bool = False) -> None:
        """`window`: every layer's sliding window (keys a query sees, itself included), when
        all layers have one; blocks no query can reach any more are then released.
        `max_blocks_per_stream` (default: the pool) is the block-table array's width; a
        step that would grow a stream past it raises ValueError before changing anything.
        `slots`: the array's initial rows (it grows when more streams run at once)."""
        self.block_size = block_size
        self.window = window
        self.blocks_dropped = 0  # blocks released by windows, in total
        self.pool = BlockPool(num_blocks)
        self.tables = BlockTables(max_blocks_per_stream or num_blocks, slots, pin_tables)
        self.enable_prefix_caching = enable_prefix_caching
        self.streams: dict[str, StreamState] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found cached
        self.host: HostTier | None = None
        # streams parked while their blocks' write-back is in flight: blocks stay referenced
        self.held: dict[str, list[int]] = {}
        # blocks a live move (workers/engine/live_move.py) reserved here for a stream on its
        # way in, by request id: owned by no stream until the move commits
        self.reserved: dict[str, list[int]] = {}
        self._demoted: list[tuple[int, int]] = []

    def attach_host(self, host: HostTier) -> None:
        self.host = host
        self.pool.on_evict = self._on_device_evict

    def _on_device_evict(self, block_id: int, block_hash: int) -> None:
        self._demoted.append((block_id, block_hash))

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_stream(self, stream_id: str) -> bool:
        return stream_id in self.streams

    def stream(self, stream_id: str) -> StreamState:
        return self.streams[stream_id]

    def block_table(self, stream_id: str) -> list[int]:
        return self.streams[stream_id].block_ids

    def num_computed(self, stream_id: str) -> int:
        s = self.streams.get(stream_id)
        return s.num_computed if s else 0

    def cached_prefix(self, token_ids: list[int], limit: int | None = None,
                      root: int = ROOT_HASH) -> list[int]:
        """Block ids holding the longest cached full-block prefix of `token_ids`.

        `limit` caps the prefix length in tokens (a step must compute at least
        the last prompt token to produce logits).
        """
        if not self.enable_prefix_caching:
            return []
        n = len(token_ids) if limit is None else min(limit, len(token_ids))
        out: list[int] = []
        parent = root
        bs = self.block_size
        for b in range(n // bs):
            parent = hash_block(parent, token_ids[b * bs : (b + 1) * bs])
            blk = self.pool.lookup(parent)
            if blk is None:
                break
            out.append(blk)
        return out

    def lookup_prefix(self, token_ids: list[int], limit: int, resume: ParkedKV | None = None,
                      use_host: bool = True, root: int = ROOT_HASH) -> PrefixHit:
        """The longest known prefix of a new stream: device prefix hits first, then host
        hits (by copy; not with `use_host` False), then, for a resumed stream whose full
        blocks all came back, its private partial tail. What neither tier holds is
        recomputed."""
        n = min(limit, len(token_ids))
        bs = self.block_size
        host = self.host
        if not use_host:
            host = resume = None
        use_host = host is not None and (self.enable_prefix_caching or resume is not None)
        dev: list[int] = []
        on_host: list[int] = []
        parent = root
        for b in range(n // bs):
            parent = hash_block(parent, token_ids[b * bs : (b + 1) * bs])
            if not on_host and self.enable_prefix_caching:
                blk = self.pool.lookup(parent)
                if blk is not None:
                    dev.append(blk)
                    continue
            hb = host.lookup(parent) if use_host and host is not None else None
            if hb is None:
                break
            on_host.append(hb)
        num = (len(dev) + len(on_host)) * bs
        tail = None
        if (resume is not None and resume.tail_block is not None
                and num == resume.num_tokens - resume.tail_tokens and resume.num_tokens <= n):
            tail = resume.tail_block
            num = resume.num_tokens
        return PrefixHit(dev, on_host, tail, num)

    # ---- plan / apply --------------------------------------------------------------------
    def reserve(self, steps: list[StreamStep]) -> StepPlan:
        """Reserve every block the step writes, all or nothing.

        A running stream costs a few attribute reads and writes here, while its state is in
        cache (its decode step usually needs no new block, its `num_computed` advances here
        rather than in commit, and its PlannedStream object is the one of its last step,
        updated: commit or roll back a plan before reserving the next); only new streams look
        up prefixes, revive cached blocks and pin host ones.
        """
        planned: list[PlannedStream] = []
        try:
            return self._reserve(steps, planned)
        except BaseException:
            for p in planned:  # running streams advanced before the step was refused
                if not p.is_new:
                    p.state.num_computed = p.start  # type: ignore[union-attr]
            raise

    def _reserve(self, steps: list[StreamStep], planned: list[PlannedStream]) -> StepPlan:
        bs = self.block_size
        width = self.tables.width
        streams = self.streams
        caching = self.enable_prefix_caching
        fresh: list[PlannedStream] = []  # the new streams among `planned`
        takers: list[PlannedStream] = []  # streams that take blocks, in plan order
        publish: list[PlannedStream] = []  # streams whose step fills a block
        # blocks revived from the free-but-cached state reduce what is free for new blocks
        revived: set[int] = set()
        need_new = 0
        num_tokens = 0
        num_drafts = 0
        token_ids: dict[str, list[int]] = {}
        for st in steps:
            sid = st.stream_id
            if sid in token_ids:
                raise ValueError(f"stream {sid!r} appears twice in one step")
            toks = token_ids[sid] = st.token_ids
            target = st.target
            state = streams.get(sid)
            if state is not None:  # a running stream: the path every decode step takes
                start = state.num_computed
                p = state.plan
                draft = st.draft
                if draft:  # its proposals are inputs of the step, never hashed (commit)
                    if st.pending:
                        raise ValueError(f"stream {sid!r}: proposals after a token on the device")
                    toks = token_ids[sid] = toks + draft
                    num_drafts += len(draft)
                if not start < target <= len(toks) + st.pending or p is None or p.is_new:
                    p = self._running_plan(state, st, toks)
                p.start = start
                p.target = target
                p.drafts = len(draft)
                num_tokens += target - start
                n_new = -(-target // bs) - len(state.block_ids)
                if n_new > 0:
                    if n_new + len(state.block_ids) > width:
                        raise ValueError(f"stream {sid!r}: {target} tokens exceed the {width}-block table")
                    need_new += n_new
                    p.num_new_blocks = n_new
                    p.new_blocks = _NONE
                    takers.append(p)
                elif p.num_new_blocks:  # its last step took blocks
                    p.num_new_blocks = 0
                    p.new_blocks = _NONE
                state.num_computed = target
                planned.append(p)
                if caching and target // bs > len(state.block_hashes):
                    publish.append(p)
                continue
            if not 0 < target <= len(toks):
                raise ValueError(f"target {target} outside 1..{len(toks)}")
            if sid in self.held:
                raise ValueError(f"stream {sid!r} is still being written back")
            if st.pending or st.draft:
                raise ValueError(f"new stream {sid!r} cannot have tokens on the device or "
                                 "proposals")
            if self.blocks_needed(target) > width:
                raise ValueError(f"stream {sid!r}: {target} tokens exceed the {width}-block table")
            hit = self.lookup_prefix(st.token_ids, target - 1, st.resume, st.use_host, st.root)
            cached = hit.device_blocks
            host_ids = hit.host_blocks + ([hit.tail_block] if hit.tail_block is not None else [])
            start = hit.num_tokens
            for b in cached:
                if self.pool.is_free(b):
                    revived.add(b)
            n_new = max(0, self.blocks_needed(target) - len(cached))
            need_new += n_new
            ps = PlannedStream(sid, start, target, [], [], cached, True, n_new, root=st.root)
            ps.host_in = [(h, -1) for h in host_ids]
            ps.host_tokens = start - len(cached) * bs
            num_tokens += target - start
            planned.append(ps)
            fresh.append(ps)
            takers.append(ps)
            if caching and target // bs > len(cached):
                publish.append(ps)
        free_after_revive = self.pool.num_free - len(revived)
        if need_new > free_after_revive:
            raise KVCacheFull(need_new + len(revived), self.pool.num_free)

        # apply: nothing below can fail for lack of space. Revive every prefix hit
        # before allocating, so allocation cannot hand out a block another stream
        # of this step is about to share.
        for p in fresh:
            self.pool.touch(p.cached_blocks)
            state = StreamState(block_ids=list(p.cached_blocks), num_computed=p.target, root=p.root)
            state.num_cached_prompt = p.start
            state.plan, p.state = p, state
            state.block_hashes = self._hashes_of(p.cached_blocks)
            streams[p.stream_id] = state
            self.prefix_queries += p.target
            self.prefix_hits += p.start
        restores = [p for p in fresh if p.host_in]
        if self.host is not None:
            for p in restores:
                # pinned until commit/rollback: the copy below the plan reads them
                self.host.pin([h for h, _ in p.host_in])
        # allocate in plan order (block ids, and the cached blocks the allocator drops, do
        # not depend on which streams are new)
        allocate = self.pool.allocate
        tables = self.tables
        for p in takers:
            if p.is_new:
                state = streams[p.stream_id]
                last = state.block_ids[-1] if state.block_ids else None
                new = allocate(p.num_new_blocks, after=last)
                state.block_ids.extend(new)
                p.new_blocks = new
                p.block_ids = state.block_ids
                p.host_in = [(h, d) for (h, _), d in zip(p.host_in, new, strict=False)]
                p.slot = state.slot = tables.add(state.block_ids)
            else:
                ids = p.block_ids
                new = allocate(p.num_new_blocks, after=ids[-1] if ids else None)
                tables.write(p.slot, len(ids), new)
                ids.extend(new)
                p.new_blocks = new
        demoted, self._demoted = self._demoted, []
        return StepPlan(planned, token_ids, demoted, tables, restores, num_tokens, publish,
                        num_drafts)

    def _running_plan(self, state: StreamState, st: StreamStep,
                      toks: list[int]) -> PlannedStream:
        """Check a running stream's step; its plan object (made on its first running step)."""
        sid, target, start = st.stream_id, st.target, state.num_computed
        if not 0 < target <= len(toks) + st.pending:
            raise ValueError(f"target {target} outside 1..{len(toks) + st.pending}")
        if st.draft and target != len(toks):
            raise ValueError(f"stream {sid!r}: a step with proposals computes all of them")
        if target <= start:
            raise ValueError(f"stream {sid!r}: target {target} <= computed {start}")
        p = state.plan
        if p is None or p.is_new:
            p = state.plan = PlannedStream(sid, start, target, state.block_ids, _NONE, _NONE,
                                           False, 0, _NO_PAIRS, 0, state.slot, state)
        return p

    def _unpin(self, plan: StepPlan) -> None:
        if self.host is None:
            return
        for p in plan.restores:
            if p.host_in:
                self.host.unpin([h for h, _ in p.host_in])
                p.host_in = []

    def commit(self, plan: StepPlan) -> None:
        """The step's KV is written: publish the blocks it filled to the prefix cache."""
        bs = self.block_size
        self._unpin(plan)
        for p in plan.publish:  # most decode steps fill no block: nothing to hash
            state: StreamState = p.state  # type: ignore[assignment]
            tokens = plan.token_ids[p.stream_id]
            # a token still on the device is hashed later; proposals never are (the ones
            # kept were accepted first: `accept_drafts`)
            full = min(p.target, len(tokens) - p.drafts) // bs
            parent = state.block_hashes[-1] if state.block_hashes else state.root
            for b in range(len(state.block_hashes), full):
                parent = hash_block(parent, tokens[b * bs : (b + 1) * bs])
                state.block_hashes.append(parent)
                self.pool.register(state.block_ids[b], parent)
        window = self.window
        if window is None:
            return
        for p in plan.streams:
            state = p.state  # type: ignore[assignment]
            # the stream's next query sees keys from target - window + 1 on (GPU work that
            # still reads a released block runs before any later step that reuses it)
            first_key = p.target - window + 1
            if first_key >= (state.num_dropped + 1) * bs and self.streams.get(p.stream_id) is state:
                self._drop_unreachable(state, first_key)

    def accept_drafts(self, plan: StepPlan, p: PlannedStream, accepted: int) -> None:
        """After a step with proposals and before its commit: keep the KV of the first
        `accepted` of the stream's `p.drafts` proposed positions; the rest is rolled back (the
        stream's computed length goes back, blocks past it return to the pool) and so is never
        hashed into the prefix cache nor written to the host tier."""
        rejected = p.drafts - accepted
        if not 0 <= accepted <= p.drafts:
            raise ValueError(f"stream {p.stream_id!r}: {accepted} of {p.drafts} proposals")
        p.drafts = 0
        plan.num_drafts -= accepted + rejected
        if rejected == 0:
            return
        state: StreamState = p.state  # type: ignore[assignment]
        keep = p.target - rejected
        p.target = state.num_computed = keep
        del plan.token_ids[p.stream_id][keep:]  # the step's own copy (`reserve`)
        spare = len(state.block_ids) - self.blocks_needed(keep)
        if spare > 0:  # only blocks this step took lie wholly past the kept positions
            blocks = state.block_ids[-spare:]
            del state.block_ids[-spare:]
            self.pool.unallocate(blocks)
            p.new_blocks = p.new_blocks[: len(p.new_blocks) - spare]
            p.num_new_blocks = len(p.new_blocks)

    def truncate(self, stream_id: str, num_tokens: int) -> None:
        """Cut a running stream's KV back to its first `num_tokens` tokens (a draft model's
        stream whose proposals were not all accepted): blocks past them return to the pool.
        The cut must leave every block published to the prefix cache whole."""
        state = self.streams[stream_id]
        if num_tokens >= state.num_computed:
            return
        if num_tokens < len(state.block_hashes) * self.block_size:
            raise ValueError(f"stream {stream_id!r}: cutting to {num_tokens} tokens would "
                             "change a block in the prefix cache")
        state.num_computed = num_tokens
        need = max(self.blocks_needed(num_tokens), state.num_dropped)
        spare = state.block_ids[need:]
        if spare:
            del state.block_ids[need:]
            self.pool.release(reversed(spare))
        state.plan = None

    def _drop_unreachable(self, state: StreamState, first_key: int) -> None:
        """Release the blocks wholly before `first_key`. Full ones were published above, so
        they stay findable in the prefix cache until the allocator reuses them."""
        n = first_key // self.block_size
        self.pool.release(reversed(state.block_ids[state.num_dropped : n]))
        self.blocks_dropped += n - state.num_dropped
        state.num_dropped = n

    def rollback(self, plan: StepPlan) -> None:
        """The step failed: return its reserved blocks; streams go back to what they had
        computed before it."""
        self._unpin(plan)
        for p in reversed(plan.streams):
            state = self.streams.get(p.stream_id)
            if state is None:
                continue
            if p.new_blocks:
                del state.block_ids[len(state.block_ids) - len(p.new_blocks) :]
                self.pool.unallocate(p.new_blocks)
            if p.is_new:
                self.pool.release(reversed(p.cached_blocks))
                del self.streams[p.stream_id]
                self.tables.remove(state.slot)
                self.prefix_queries -= p.target
                self.prefix_hits -= p.start
            else:
                state.num_computed = p.start

    def free(self, stream_id: str) -> None:
        """Release a stream's blocks (tail first, so its prefix stays cached longest)."""
        state = self.streams.pop(stream_id, None)
        if state is not None:
            self.pool.release(reversed(state.live_blocks))
            self.tables.remove(state.slot)
        self.release_held(stream_id)

    def hold(self, stream_id: str) -> StreamState:
        """Take a stream out of the batch but keep its blocks referenced (write-back in flight)."""
        state = self.streams.pop(stream_id)
        self.held[stream_id] = state.live_blocks
        self.tables.remove(state.slot)  # it leaves the batch; the blocks stay referenced
        return state

    def unhold(self, stream_id: str, state: StreamState) -> None:
        """Put a stream taken out by `hold` back in the batch with the same blocks (a live
        move that did not commit)."""
        blocks = self.held.pop(stream_id)
        assert blocks == state.live_blocks, "a held stream's blocks changed"
        state.slot = self.tables.add(state.block_ids)
        state.plan = None
        self.streams[stream_id] = state

    # ---- live moves: blocks reserved for a stream arriving from another engine ----------
    def reserve_blocks(self, key: str, n: int) -> list[int]:
        """Take `n` more free blocks for `key`'s reservation (raises KVCacheFull, changing
        nothing, when fewer are free). Cached content the allocator drops is demoted to the
        host tier at once: the move writes into these blocks before any step could."""
        if n > self.pool.num_free:
            raise KVCacheFull(n, self.pool.num_free)
        have = self.reserved.setdefault(key, [])
        new = self.pool.allocate(n, after=have[-1] if have else None)
        have.extend(new)
        demoted, self._demoted = self._demoted, []
        if demoted and self.host is not None:
            self.host.demote(demoted)
        return new

    def release_reservation(self, key: str) -> int:
        """Return a reservation's blocks (the move was called off); how many."""
        blocks = self.reserved.pop(key, [])
        self.pool.unallocate(blocks)
        return len(blocks)

    def adopt_reserved(self, key: str, num_computed: int, hashes: list[int],
                       root: int = ROOT_HASH) -> StreamState:
        """Make a reservation a running stream holding `num_computed` tokens of KV (written
        into its first blocks by the move); `hashes` are its full blocks' chained hashes,
        published to the prefix cache (chained from `root`, its adapter's). Blocks beyond
        what the tokens fill go back."""
        blocks = self.reserved.pop(key)
        need = self.blocks_needed(num_computed)
        if need > len(blocks):
            self.reserved[key] = blocks
            raise ValueError(f"stream {key!r}: {num_computed} tokens need {need} blocks, "
                             f"{len(blocks)} reserved")
        keep, spare = blocks[:need], blocks[need:]
        self.pool.unallocate(spare)
        state = StreamState(block_ids=list(keep), num_computed=num_computed,
                            block_hashes=list(hashes[: num_computed // self.block_size]),
                            root=root)
        if self.enable_prefix_caching:
            for b, h in zip(state.block_ids, state.block_hashes, strict=False):
                self.pool.register(b, h)
        else:
            state.block_hashes = []
        state.slot = self.tables.add(state.block_ids)
        self.streams[key] = state
        return state

    def release_held(self, stream_id: str) -> None:
        blocks = self.held.pop(stream_id, None)
        if blocks is not None:
            self.pool.release(reversed(blocks))

    def reset_prefix_cache(self) -> int:
        hook, self.pool.on_evict = self.pool.on_evict, None  # a reload makes the KV stale
        try:
            n = self.pool.evict_cached()
        finally:
            self.pool.on_evict = hook
        if self.host is not None:
            n += self.host.table.evict_cached()
        return n

    def _hashes_of(self, block_ids: list[int]) -> list[int]:
        out = []
        for b in block_ids:
            h = self.pool.block_hash[b]
            assert h is not None
            out.append(h)
        return out

    # ---- accounting ----------------------------------------------------------------------
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        free_slots = set(self.tables.free_slots())
        slots = set()
        for sid, s in self.streams.items():
            if len(s.block_ids) * self.block_size < s.num_computed:
                raise AssertionError(f"stream {sid}: {s.num_computed} tokens in {len(s.block_ids)} blocks")
            if s.slot in free_slots or s.slot in slots or not 0 <= s.slot < self.tables.slots:
                raise AssertionError(f"stream {sid}: slot {s.slot} is free or shared")
            slots.add(s.slot)
            if self.tables.array[s.slot, : len(s.block_ids)].tolist() != s.block_ids:
                raise AssertionError(f"stream {sid}: its block-table row differs from its blocks")
            for b in s.live_blocks:
                refs[b] += 1
        for blocks in [*self.held.values(), *self.reserved.values()]:
            for b in blocks:
                refs[b] += 1
        if refs != self.pool.ref_cnt:
            raise AssertionError("block reference counts do not match the block tables")
        if len(slots) + len(free_slots) != self.tables.slots:
            raise AssertionError("a block-table row is neither free nor owned by a stream")
