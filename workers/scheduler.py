"""Batch planning: which streams run this step and how far, with KV reserved up front.

Every step decodes one token for each running stream and fills the rest of the
token budget with (chunked) prefill of waiting prompts, first come first served.
The plan is reserved in the KV cache as a whole; if it does not fit, newly
admitted prompts are dropped from it first, then the newest running stream is
preempted (its blocks freed, kept as prefix cache) and re-queued at the head,
to be recomputed from its prompt and generated tokens when space frees.
"""

from __future__ import annotations

from collections import deque

from kvserve.kvcache.manager import KVCacheFull, KVCacheManager, StepPlan, StreamStep
from kvserve.workers.sequence import Sequence, Status


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

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
        budget = self.max_tokens
        steps: list[StreamStep] = []
        seqs: list[Sequence] = []
        for s in self.running:
            if budget <= 0:
                break
            ids = s.all_ids
            done = self.kv.num_computed(s.request_id)
            n = min(len(ids) - done, budget)
            steps.append(StreamStep(s.request_id, ids, done + n))
            seqs.append(s)
            budget -= n
        admitted: list[Sequence] = []
        while (
            self.waiting
            and budget > 0
            and len(admitted) < max_admit
            and len(self.running) < self.max_num_seqs
        ):
            s = self.waiting.popleft()
            ids = s.all_ids
            cached = len(self.kv.cached_prefix(ids, limit=len(ids) - 1)) * self.kv.block_size
            n = min(len(ids) - cached, budget)
            s.status = Status.RUNNING
            self.running.append(s)
            admitted.append(s)
            steps.append(StreamStep(s.request_id, ids, cached + n))
            seqs.append(s)
            budget -= n
        return steps, seqs, admitted

    def _preempt(self) -> bool:
        """Free the newest admitted running stream and queue it for recompute."""
        if len(self.running) <= 1:
            return False
        victim = max(self.running, key=lambda s: s.arrival)
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return True
