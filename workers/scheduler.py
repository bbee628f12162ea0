"""Batch planning: which streams run this step and how far, with KV reserved up front.

Every step decodes one token for each running stream and fills the rest of the
token budget (`max_num_batched_tokens`) with chunked prefill of waiting prompts,
in priority then arrival order (FCFS when all priorities are equal).

Admission keeps headroom: a prompt is admitted only if, after its blocks, enough
free blocks remain for the running streams' next `admission_lookahead` tokens,
so running out of KV mid-generation is rare. When a step still does not fit,
the whole plan is retried without the newest admissions, then a running stream
chosen by the preemption policy is preempted: its blocks are freed (they stay
in the prefix cache) and it goes back to the head of the queue, to be recomputed
from its prompt and generated tokens when space frees.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

from kvserve.kvcache.manager import KVCacheFull, KVCacheManager, StepPlan, StreamStep
from kvserve.workers.sequence import Sequence, Status

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
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.choose_victim = PREEMPTION_POLICIES[preemption] if isinstance(preemption, str) else preemption
        self.lookahead_blocks = kv.blocks_needed(admission_lookahead)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue behind every request of the same or higher priority (lower value first)."""
        if not self.waiting or self.waiting[-1].priority <= seq.priority:
            self.waiting.append(seq)
            return
        keys = [(s.priority, s.arrival) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, (seq.priority, seq.arrival)), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.request_id)

    def schedule(self) -> tuple[StepPlan | None, list[Sequence]]:
        """Pick this step's streams and reserve their KV; (None, []) when idle."""
        max_admit = self.max_num_seqs
        while True:
            steps, seqs, admitted = self._pick(max_admit)
            if not steps:
                return None, []
            try:
                plan = self.kv.reserve(steps)
            except KVCacheFull:
                if admitted:
                    # put the newest admitted prompt back and try with one fewer
                    for s in reversed(admitted):
                        self.running.remove(s)
                        s.status = Status.WAITING
                        self.waiting.appendleft(s)
                    max_admit = len(admitted) - 1
                    continue
                if not self._preempt():
                    raise
                continue
            for s, p in zip(seqs, plan.streams, strict=True):
                if p.is_new:
                    s.num_cached_prompt = min(p.start, len(s.prompt_ids))
            return plan, seqs

    def _pick(self, max_admit: int) -> tuple[list[StreamStep], list[Sequence], list[Sequence]]:
        kv = self.kv
        budget = self.max_tokens
        steps: list[StreamStep] = []
        seqs: list[Sequence] = []
        free = kv.num_free_blocks
        headroom = 0
        for s in self.running:
            ids = s.all_ids
            done = kv.num_computed(s.request_id)
            have = len(kv.block_table(s.request_id)) if kv.has_stream(s.request_id) else 0
            final = kv.blocks_needed(s.max_len)
            headroom += min(self.lookahead_blocks, max(0, final - have))
            if budget <= 0:
                continue
            n = min(len(ids) - done, budget)
            steps.append(StreamStep(s.request_id, ids, done + n))
            seqs.append(s)
            budget -= n
            free -= max(0, kv.blocks_needed(done + n) - have)
        admitted: list[Sequence] = []
        while (
            self.waiting
            and budget > 0
            and len(admitted) < max_admit
            and len(self.running) < self.max_num_seqs
        ):
            s = self.waiting[0]
            ids = s.all_ids
            cached = len(kv.cached_prefix(ids, limit=len(ids) - 1)) * kv.block_size
            n = min(len(ids) - cached, budget)
            need = kv.blocks_needed(cached + n) - cached // kv.block_size
            if self.running and free - need < headroom:
                break  # keep room for the running streams' next tokens
            self.waiting.popleft()
            s.status = Status.RUNNING
            self.running.append(s)
            admitted.append(s)
            steps.append(StreamStep(s.request_id, ids, cached + n))
            seqs.append(s)
            budget -= n
            free -= need
            headroom += min(self.lookahead_blocks, max(0, kv.blocks_needed(s.max_len) - need))
        return steps, seqs, admitted

    def _preempt(self) -> bool:
        """Free a running stream chosen by the policy and queue it for recompute."""
        if len(self.running) <= 1:
            return False
        victim = self.choose_victim(self.running, self.kv)
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return True
