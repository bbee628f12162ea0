"""Batch planning: which streams run this step and how far, with KV reserved up front.

Every step decodes one token for each running stream and fills the rest of the
token budget (`max_num_batched_tokens`) with chunked prefill of waiting prompts,
in priority then arrival order (FCFS when all priorities are equal).

Admission keeps headroom: a prompt is admitted only if, after its blocks, enough
free blocks remain for the running streams' next `admission_lookahead` tokens,
so running out of KV mid-generation is rare. When a step still does not fit,
the whole plan is retried without the newest admissions, then a running stream
chosen by the preemption policy is evicted and parked.

With a host tier, eviction writes the stream's blocks back to host memory (blocks
already there are not copied again) and frees its device blocks only once that
copy has completed. Without one, the blocks are freed at once (they stay in the
prefix cache) and the lost part is recomputed. Parked streams come back before
any new request, FIFO by park time, as soon as they fit with headroom: device
prefix hits first, then host hits by copy, then recompute for the rest.

Copies happen only where they are cheaper than recomputing (`kvcache/restore_cost.py`): an
eviction writes back only when copying the stream out and in costs less than recomputing it,
and an admission uses the host's blocks only when copying them in costs less; otherwise
they are recomputed (the choice and its reason go with the stream, `Sequence.restore_choice`).

Under asynchronous scheduling a running stream may have one sampled token still on the
device (`Sequence.inflight_row`): it is planned one token further, with that token as its
input. A stream that will certainly finish with that token (its length limit), or that is
handed to another worker after its first token (`Sequence.handoff`), is not planned again,
one with `requires_sync` waits for the token, and a parked stream is not
admitted until its last token has arrived.

LoRA (`adapters.py`): a stream of an adapter is admitted only with its adapter in a device
slot (copied in from host memory at admission when it is not); one whose adapter finds every
slot held by running streams of other adapters waits while the streams behind it go ahead.
Running streams keep their adapter's slot; parking or finishing lets it go. The running
streams are kept grouped by adapter, so each adapter's rows of a step are contiguous.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvserve.kvcache.hashing import hash_full_blocks
from kvserve.kvcache.host_cache import ParkedKV
from kvserve.kvcache.manager import KVCacheFull, KVCacheManager, PrefixHit, StepPlan, StreamStep
from kvserve.workers.engine.sequence import NO_DRAFT, Sequence, Status

if TYPE_CHECKING:
    from kvserve.workers.engine.adapters import AdapterManager

PreemptionPolicy = Callable[[list[Sequence], KVCacheManager], Sequence]

# victim choosers: newest admitted (least work lost on average), least computed, largest
PREEMPTION_POLICIES: dict[str, PreemptionPolicy] = {
    "newest": lambda running, kv: max(running, key=lambda s: s.arrival),
    "least_computed": lambda running, kv: min(running, key=lambda s: kv.num_computed(s.request_id)),
    "largest": lambda running, kv: max(running, key=lambda s: len(kv.block_table(s.request_id))
                                       if kv.has_stream(s.request_id) else 0),
}


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption: str | PreemptionPolicy = "newest",
        admission_lookahead: int = 128,
        max_evictions_per_request: int = 4,
        adapters: AdapterManager | None = None,
    ) -> None:
        self.kv = kv
        self.adapters = adapters
        self._regroup = False  # a LoRA stream joined the running list: group it by adapter
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.choose_victim = PREEMPTION_POLICIES[preemption] if isinstance(preemption, str) else preemption
        self.lookahead_blocks = kv.blocks_needed(admission_lookahead)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: deque[Sequence] = deque()  # evicted streams, oldest first
        self.inflight: list[Sequence] = []  # parked streams whose write-back is in flight
        self.max_evictions = max_evictions_per_request
        self.num_preemptions = 0
        self.evictions_over_cap = 0
        self.writebacks_skipped = 0  # evictions not written back: recomputing is cheaper
        self.drafts_dropped = 0  # steps planned again without proposals, which did not fit
        # about the last schedule(): the rows whose step reaches their last known token and
        # so sample (None: all of them), and where its admitted streams start in its list
        self.sampled: list[int] | None = None
        self.first_new = 0
        self._partial: list[int] = []  # rows of the plan being picked that do not sample

    def add(self, seq: Sequence) -> None:
        """Queue behind every request of the same or higher priority (lower value first)."""
        if not self.waiting or self.waiting[-1].priority <= seq.priority:
            self.waiting.append(seq)
            return
        keys = [(s.priority, s.arrival) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, (seq.priority, seq.arrival)), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted stream with everything it holds on device and host."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.parked:
            self.parked.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release_parked(seq)
        self.kv.free(seq.request_id)
        self.leave(seq)

    def leave(self, seq: Sequence) -> None:
        """A stream left this engine (finished, aborted, moved away): its adapter's slot and
        host copy are no longer held for it."""
        self.stop_running(seq)
        ad = seq.lora
        if ad is not None and seq.lora_pinned:
            seq.lora_pinned = False
            ad_mgr = self.adapters
            assert ad_mgr is not None
            ad_mgr.unpin(ad)

    def regroup(self) -> None:
        """A LoRA stream joined the running list from outside an admission (a live move)."""
        self._regroup = True

    def stop_running(self, seq: Sequence) -> None:
        """A stream stopped running (parked, or leaving): its adapter's slot may go."""
        if seq.lora_slot >= 0:
            seq.lora_slot = -1
            assert self.adapters is not None and seq.lora is not None
            self.adapters.release(seq.lora)

    def finish(self, seqs: list[Sequence]) -> None:
        """Drop finished streams, in one pass over the running list (under asynchronous
        scheduling a stream may finish after it was parked: it leaves that queue too)."""
        gone = set(seqs)
        n = len(self.running)
        self.running[:] = [s for s in self.running if s not in gone]
        if n - len(self.running) != len(seqs):
            for q in (self.parked, self.waiting):
                for s in [s for s in q if s in gone]:
                    q.remove(s)
        for seq in seqs:
            self.release_parked(seq)
            self.kv.free(seq.request_id)
            if seq.lora is not None:
                self.leave(seq)

    def release_parked(self, seq: Sequence) -> None:
        """Drop a parked stream's host pins (after its in-flight copy, if any, completed)."""
        if seq in self.inflight:
            self.inflight.remove(seq)
        parked = seq.parked_kv
        if parked is not None and self.kv.host is not None:
            self.kv.host.release(parked)
        self.kv.release_held(seq.request_id)
        seq.parked_kv = None

    def _reap(self, wait: bool) -> bool:
        """Free the device blocks of evicted streams whose write-back has completed."""
        freed = False
        for seq in list(self.inflight):
            parked = seq.parked_kv
            t = parked.transfer if parked is not None else None
            if t is not None and not wait and not t.done():
                continue
            self.inflight.remove(seq)
            if parked is not None and t is not None:
                try:
                    t.wait()
                except Exception:
                    # the host copy is unusable: fall back to recompute for all of it
                    host = self.kv.host
                    assert host is not None
                    host.release(parked, forget=parked.host_blocks + (
                        [parked.tail_block] if parked.tail_block is not None else []))
                    seq.parked_kv = ParkedKV(parked.num_tokens, block_size=self.kv.block_size)
                else:
                    parked.transfer = None
            self.kv.release_held(seq.request_id)
            freed = True
        return freed

    def schedule(self) -> tuple[StepPlan | None, list[Sequence]]:
        """Pick this step's streams and reserve their KV; (None, []) when idle."""
        max_admit = self.max_num_seqs
        # with nothing running there is nothing to overlap the copies with: wait for them
        self._reap(wait=not self.running)
        while True:
            steps, seqs, admitted = self._pick(max_admit)
            if not steps:
                return None, []
            try:
                plan = self.kv.reserve(steps)
            except KVCacheFull:
                if any(st.draft for st in steps):
                    # proposals never cost a stream its place: the step goes without them
                    self._unadmit(admitted)
                    for s in self.running:
                        s.draft = NO_DRAFT
                    self.drafts_dropped += 1
                    continue
                if admitted:
                    # put the newest admitted prompt back and try with one fewer
                    self._unadmit(admitted)
                    max_admit = len(admitted) - 1
                    continue
                if self._reap(wait=True):
                    continue  # blocks of finished write-backs came free
                if not self._preempt():
                    raise
                continue
            self.first_new = first = len(seqs) - len(admitted)
            for s, p in zip(seqs[first:], plan.streams[first:], strict=True):
                if s.num_evictions == 0:
                    s.num_cached_prompt = min(p.start, len(s.prompt_ids))
                    s.scheduled_time = s.scheduled_time or time.monotonic()
            partial = set(self._partial)
            self.sampled = [i for i in range(len(seqs)) if i not in partial] if partial else None
            return plan, seqs

    def _unadmit(self, admitted: list[Sequence]) -> None:
        for s in reversed(admitted):
            self.running.remove(s)
            self.stop_running(s)
            s.status = Status.WAITING
            (self.parked if s.parked_kv is not None else self.waiting).appendleft(s)

    def _pick(self, max_admit: int) -> tuple[list[StreamStep], list[Sequence], list[Sequence]]:
        kv = self.kv
        budget = self.max_tokens
        steps: list[StreamStep] = []
        seqs: list[Sequence] = []
        partial = self._partial = []
        free = kv.num_free_blocks
        headroom = 0
        # the running streams' loop runs every step for every stream: plain arithmetic on
        # the manager's stream states (ceil division as -(-a // b))
        bs = kv.block_size
        lookahead = self.lookahead_blocks
        states = kv.streams
        if self._regroup:  # each adapter's streams side by side (a stable sort: base first)
            self.running.sort(key=_slot_of)
            self._regroup = False
        for s in self.running:
            if budget <= 0:
                break
            state = states.get(s.request_id)
            done = 0 if state is None else state.num_computed
            ids = s.all_ids
            if s.inflight_row >= 0:
                if s.requires_sync or s.handoff or len(ids) + 1 >= s.max_len:
                    continue  # waits for its token, finishes with it, or is handed off
                pending = 1
            else:
                pending = 0
            n = len(ids) + pending - done
            draft = s.draft  # proposals (speculative decoding): only after a decode token
            if draft:
                if n == 1 and not pending and len(draft) < budget:
                    n += len(draft)
                else:
                    draft = s.draft = NO_DRAFT
            if n > budget:
                n = budget
                partial.append(len(seqs))  # a chunk short of its last token: nothing to sample
            st = s.kv_step  # the stream's request object, updated rather than rebuilt
            st.target = done + n
            st.pending = pending
            st.draft = draft
            steps.append(st)
            seqs.append(s)
            budget -= n
        # headroom and free blocks matter only when something may be admitted
        if (self.parked or self.waiting) and len(self.running) < self.max_num_seqs:
            for s in self.running:
                state = states.get(s.request_id)
                grow = -(-s.max_len // bs) - (0 if state is None else len(state.block_ids))
                if grow > 0:
                    headroom += grow if grow < lookahead else lookahead
            for st in steps:
                state = states.get(st.stream_id)
                grow = -(-st.target // bs) - (0 if state is None else len(state.block_ids))
                if grow > 0:
                    free -= grow
        admitted: list[Sequence] = []
        blocked: set[int] = set()  # ids of streams whose adapter has no slot this step
        while (
            (self.parked or self.waiting)
            and budget > 0
            and len(admitted) < max_admit
            and len(self.running) < self.max_num_seqs
        ):
            queue = self.parked if self.parked else self.waiting  # parked streams first
            s = queue[0]
            if blocked:  # streams of adapters without a slot step aside for those behind
                s = self._next_unblocked(blocked)
                if s is None:
                    break
                queue = self.parked if s in self.parked else self.waiting
            if s.request_id in kv.held or s.inflight_row >= 0:
                break  # its write-back, or its last token, is still in flight
            ids = s.all_ids
            hit, use_host = self._prefix(s, ids)
            cached = hit.num_tokens
            # restored tokens are copied, not computed: only the rest counts against the budget
            n = min(len(ids) - cached, budget)
            need = kv.blocks_needed(cached + n) - len(hit.device_blocks)
            if self.running and free - need < headroom:
                break  # keep room for the running streams' next tokens
            if s.lora is not None:
                assert self.adapters is not None
                slot = self.adapters.acquire(s.lora)
                if slot < 0:
                    blocked.add(id(s))
                    continue
                s.lora_slot = slot
                self._regroup = True
            if cached + n < len(ids):
                partial.append(len(seqs))
            if s is queue[0]:
                queue.popleft()
            else:
                queue.remove(s)
            s.status = Status.RUNNING
            self.running.append(s)
            admitted.append(s)
            steps.append(StreamStep(s.request_id, ids, cached + n, s.parked_kv, use_host=use_host,
                                    root=s.kv_step.root))
            seqs.append(s)
            budget -= n
            free -= need
            headroom += min(self.lookahead_blocks, max(0, kv.blocks_needed(s.max_len) - need))
        return steps, seqs, admitted

    def _next_unblocked(self, blocked: set[int]) -> Sequence | None:
        """The first queued stream (parked ones first) not waiting for an adapter slot."""
        for q in (self.parked, self.waiting):
            for s in q:
                if id(s) not in blocked:
                    return s
        return None

    def _prefix(self, s: Sequence, ids: list[int]) -> tuple[PrefixHit, bool]:
        """An admission's known prefix, and whether it takes the host's part by copy: only
        where copying it in is cheaper than recomputing it. A parked stream keeps the choice."""
        kv = self.kv
        root = s.kv_step.root
        hit = kv.lookup_prefix(ids, len(ids) - 1, s.parked_kv, root=root)
        choice = None
        host_tokens = hit.num_tokens - len(hit.device_blocks) * kv.block_size
        if host_tokens > 0 and kv.host is not None:
            choice = kv.host.cost.choose(host_tokens)
            if not choice.copy:
                hit = kv.lookup_prefix(ids, len(ids) - 1, None, use_host=False, root=root)
        if s.parked_kv is not None:
            s.restore_choice = choice or s.parked_kv.choice
        return hit, choice is None or choice.copy

    def _preempt(self) -> bool:
        """Evict a running stream chosen by the policy and park it.

        Streams evicted `max_evictions` times already are exempt while another can go;
        when every running stream reached the cap, the policy picks among all of them
        (counted in `evictions_over_cap`) rather than stalling the engine.
        """
        if len(self.running) <= 1:
            return False
        eligible = [s for s in self.running if s.num_evictions < self.max_evictions]
        if not eligible:
            eligible = self.running
            self.evictions_over_cap += 1
        victim = self.choose_victim(eligible, self.kv)
        self.running.remove(victim)
        self.park(victim)
        self.num_preemptions += 1
        return True

    def park(self, seq: Sequence) -> None:
        """Take a stream off the device: write its blocks back to host (if there is a host
        tier) and queue it behind the streams parked before it."""
        kv = self.kv
        rid = seq.request_id
        n = kv.num_computed(rid)
        parked = ParkedKV(n, block_size=kv.block_size)
        # a stream whose window released its first blocks has no whole chain to save: it is
        # recomputed when it resumes
        choice = None
        if kv.host is not None and n > 0 and kv.stream(rid).num_dropped == 0:
            # written back only if copying it out and in beats recomputing it
            choice = kv.host.cost.choose(n, round_trip=True)
        if choice is not None and choice.copy:
            state = kv.stream(rid)
            hashes = state.block_hashes
            if len(hashes) != n // kv.block_size:  # prefix caching off: hash here
                hashes = hash_full_blocks(seq.all_ids[:n], kv.block_size, parent=seq.kv_step.root)
            parked = kv.host.park(state.block_ids, hashes, n)
            kv.hold(rid)
            if parked.transfer is not None and not parked.transfer.done():
                self.inflight.append(seq)
            else:
                if parked.transfer is not None:
                    parked.transfer.wait()  # completed: runs its finish step
                parked.transfer = None
                kv.release_held(rid)
        else:
            kv.free(rid)
            if choice is not None:
                parked.choice = choice
                self.writebacks_skipped += 1
        self.stop_running(seq)
        seq.parked_kv = parked
        seq.num_evictions += 1
        seq.status = Status.WAITING
        self.parked.append(seq)


def _slot_of(s: Sequence) -> int:
    return s.lora_slot
