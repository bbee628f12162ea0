"""Speculative decoding in the engine: proposals before a step, their verification after it.

Each step, before the scheduler plans it, `Speculator.propose` gives decode-ready running
streams proposed tokens (`Sequence.draft`, as many as `SpecPolicy` finds worth their cost);
the scheduler puts them in the stream's step, which computes their KV and returns the logits
of every proposed position and of the one before (`StepInputs.sample_rows`). After the
forward, `Speculator.verify` samples those rows as plain decoding would sample each position
(row j of a stream sees the stream's output plus its first j proposals: penalties, bans,
`logit_bias`, and the grammar advanced by those proposals), walks them, and keeps the
longest run of proposals equal to the token sampled before each, plus the token sampled at
the first mismatch (or after the last proposal). The KV of the proposals past that run is
rolled back before the step is committed (`KVCacheManager.accept_drafts`), so it never reaches
the prefix cache or the host tier, and a stream between steps only ever holds accepted tokens:
parking, snapshots, live moves and aborts see no proposals.

Sampling keeps the target's distribution exactly: a row's token is drawn as plain decoding
draws it (the exponential race, `sampler.py`), with the stream's own noise for that position.
A seeded stream draws its rows in order from its generator, and after the step the generator
is rewound to just after the rows of the emitted tokens, so the next step draws what plain
decoding would draw next. Every emitted token is therefore the token plain decoding would
emit with the same seed: a seeded request gives the same output with speculation on or off,
and whatever the batch (up to the floating-point differences of batch shapes that plain
decoding has too). For a one-token proposal (n-gram) this acceptance rule is the standard
rejection sampler: a proposal d is accepted with probability p(d), and otherwise the token is
drawn from p without d. A draft model draws its proposals with the same noise (the
generator's state cloned), so it proposes the target's token wherever the two models'
processed distributions pick the same one.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.speculative import SpeculativeConfig
from kvserve.workers.engine import constraints
from kvserve.workers.engine.sequence import NO_DRAFT, Sequence
from kvserve.workers.engine.spec_policy import (
    PROBE_EVERY,
    SAMPLE_SCALE,
    Candidate,
    SpecPolicy,
    SpecState,
    StepCost,
)
from kvserve.workers.engine.spec_propose import NgramProposer, Proposer

if TYPE_CHECKING:
    from kvserve.kvcache.manager import StepPlan
    from kvserve.workers.engine.engine import LLMEngine
    from kvserve.workers.engine.sampler import SamplerOutput

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, config: SpeculativeConfig, engine: LLMEngine) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.engine = engine
        self.proposer: Proposer
        if config.method == "ngram":
            assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            from kvserve.workers.engine.spec_draft import DraftModelProposer

            assert config.model is not None
            self.proposer = DraftModelProposer(config.model, engine, self._choose_draft)
        cost = calibrate(engine, self.k)
        self.policy = SpecPolicy(self.k, config.disable_by_batch_size, cost,
                                 None if self.proposer.free else self.proposer.step_seconds)
        # counters (engine stats): verifications, proposed and accepted tokens, and how many
        # verifications accepted at least i proposals (i = 1..k)
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_at = [0] * self.k
        self.spec_steps = 0  # steps that verified proposals
        self.proposals_cut = 0  # proposed tokens a grammar refused (cut before verifying)
        self._t0 = 0.0
        self._shape: tuple[int, int] | None = None  # a decode step's rows and keys read

    # ---- before the step -----------------------------------------------------------------
    def propose(self) -> None:
        """Give the decode-ready running streams this step's proposals (`Sequence.draft`)."""
        self._t0 = time.perf_counter()
        eng = self.engine
        sched = eng.scheduler
        states = eng.kv.streams
        seqs: list[Sequence] = []
        rooms: list[int] = []
        other = 0
        for s in sched.running:
            s.draft = NO_DRAFT
            st = states.get(s.request_id)
            n = len(s.all_ids)
            if st is None or st.num_computed != n - 1:
                other += n - (0 if st is None else st.num_computed)  # a prompt still filling
                continue
            room = min(self.k, s.max_len - n - 1)  # the step's own token comes after them
            if room > 0 and s.finish_reason is None and not s.requires_sync and not s.handoff:
                if s.spec is None:
                    s.spec = SpecState()
                seqs.append(s)
                rooms.append(room)
        if sched.waiting or sched.parked:
            other += sum(len(s.all_ids) for s in (*sched.parked, *sched.waiting))
        budget = eng.config.max_num_batched_tokens
        other = min(other, max(0, budget - len(sched.running)))
        self.proposer.keep_only({s.request_id for s in sched.running})
        if not seqs:
            return
        free = self.proposer.free
        props: list[list[int]] = []
        if free:
            for s in seqs:
                s.spec.resolve_shadow(s.all_ids)  # type: ignore[union-attr]
            props = self.proposer.propose(seqs, rooms)
            rooms = [len(p) for p in props]
        cands = [Candidate(s.spec.alpha, len(s.all_ids), not s.params.greedy, r)  # type: ignore[union-attr]
                 for s, r in zip(seqs, rooms, strict=True)]
        ks = self.policy.lengths(cands, len(sched.running), other, 0)
        if free:
            for s, k, p in zip(seqs, ks, props, strict=True):
                spec = s.spec
                assert spec is not None
                if k:
                    self._set_draft(s, p[:k])
                elif p and spec.shadow_at < 0:  # scored against what follows instead
                    spec.shadow_at, spec.shadow = len(s.all_ids), p
            return
        for j, s in enumerate(seqs):  # a costly proposer: probe streams that stopped
            spec = s.spec
            assert spec is not None
            if ks[j]:
                spec.idle = 0
            else:
                spec.idle += 1
                if spec.idle >= PROBE_EVERY and self.policy.last_off != "batch":
                    ks[j], spec.idle = 1, 0
        pick = [j for j, k in enumerate(ks) if k]
        if not pick:
            return
        chosen = [seqs[j] for j in pick]
        for s in chosen:
            if not s.params.greedy and s.generator is None:
                # an unseeded stream's noise for this step, shared by the draft and the target
                g = torch.Generator(device=eng.runner.device)
                g.manual_seed(int(torch.randint(0, 2**62, (1,),
                                                generator=eng.sampler.shared_generator(eng.runner.device))))
                s.spec_gen = g
        drafts = self.proposer.propose(chosen, [ks[j] for j in pick])
        for s, d in zip(chosen, drafts, strict=True):
            if d:
                self._set_draft(s, d)
            else:
                s.spec_gen = None

    def forget(self, request_ids: list[str]) -> None:
        """Streams that left the engine (finished, aborted, moved away): whatever the
        proposer holds for them (a draft model's KV) goes now, not at the next step."""
        live = {s.request_id for s in self.engine.scheduler.running} - set(request_ids)
        self.proposer.keep_only(live)

    def _set_draft(self, s: Sequence, draft: list[int]) -> None:
        if s.grammar is not None:  # proposals the grammar refuses are cut
            kept = constraints.grammar_prefix(s, draft)
            self.proposals_cut += len(draft) - len(kept)
            draft = kept
        s.draft = draft or NO_DRAFT

    def _choose_draft(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                      gens: list[torch.Generator | None]) -> list[int]:
        """A draft model's next proposal for each stream: its logits processed and drawn as
        the target's row at that position will be (same parameters, same noise: `gens` are
        clones of the generators the target's rows draw from)."""
        eng = self.engine
        if any(s.guided for s in seqs):
            constraints.apply(logits, seqs, eng.grammars)  # the grammars stand after `drafts`
        res = eng.sampler.sample(
            logits, [s.params for s in seqs], [s.prompt_ids for s in seqs],
            [s.output_ids + d for s, d in zip(seqs, drafts, strict=True)], gens,
            eos_token_ids=eng.tokenizer.eos_token_ids).result()
        return res.token_ids

    # ---- after the forward ---------------------------------------------------------------
    def verify(self, plan: StepPlan, rows: list[int], seqs: list[Sequence],
               logits: torch.Tensor) -> list[tuple[list[int], list[float] | None,
                                                   list[list[tuple[int, float]]] | None]]:
        """Sample every row of the sampled streams (`rows`: their indices in the plan), keep
        each stream's accepted proposals (rolling the rest back) and return, per stream, the
        tokens it emits with their logprobs and top logprobs."""
        eng = self.engine
        streams = plan.streams
        counts = np.fromiter((p.drafts + 1 for p in streams), np.int64, len(streams))
        offs = np.cumsum(counts) - counts
        sel: list[int] = []
        r_params, r_prompt, r_out, r_gen = [], [], [], []
        drafts: list[list[int]] = []
        saved: dict[int, torch.Tensor] = {}
        for j, (i, s) in enumerate(zip(rows, seqs, strict=True)):
            p = streams[i]
            d = s.kv_step.draft if p.drafts else NO_DRAFT
            drafts.append(d)
            o = int(offs[i])
            sel.extend(range(o, o + len(d) + 1))
            gen = s.generator
            if not s.params.greedy and d:
                if gen is not None:
                    saved[j] = gen.get_state()
                else:
                    gen = s.spec_gen  # a draft model's shared noise (None: the engine's)
            for m in range(len(d) + 1):
                r_params.append(s.params)
                r_prompt.append(s.prompt_ids)
                r_out.append(s.output_ids if m == 0 else s.output_ids + d[:m])
                r_gen.append(gen)
        x = logits if len(sel) == logits.shape[0] else logits[torch.tensor(sel, device=logits.device)]
        if any(s.guided for s in seqs):
            constraints.apply_drafts(x, seqs, drafts, eng.grammars)
        res: SamplerOutput = eng.sampler.sample(
            x, r_params, r_prompt, r_out, r_gen, eos_token_ids=eng.tokenizer.eos_token_ids).result()
        toks, lps, tops = res.token_ids, res.logprobs, res.top_logprobs
        out = []
        at = 0
        vocab = logits.shape[1]
        for j, (i, s) in enumerate(zip(rows, seqs, strict=True)):
            d = drafts[j]
            t = toks[at : at + len(d) + 1]
            a = 0
            while a < len(d) and d[a] == t[a]:
                a += 1
            n = a + 1
            out.append((t[:n], None if lps is None else lps[at : at + n],
                        None if tops is None else tops[at : at + n]))
            at += len(d) + 1
            s.spec_gen = None
            if not d:
                continue
            eng.kv.accept_drafts(plan, streams[i], a)
            if j in saved and a < len(d):  # rewind: as if only the emitted rows had drawn
                gen = s.generator
                assert gen is not None
                gen.set_state(saved[j])
                scratch = torch.empty(vocab, device=logits.device)
                for _ in range(n):
                    scratch.uniform_(generator=gen)
            self.drafts += 1
            self.draft_tokens += len(d)
            self.accepted_tokens += a
            for m in range(a):
                self.accepted_at[m] += 1
            spec = s.spec
            if spec is not None:
                spec.observe(len(d), a)
                spec.shadow_at, spec.shadow = -1, []  # its verification replaces the shadow
        self.spec_steps += 1
        return out

    def planned(self, plan: StepPlan) -> None:
        """The step as planned: a decode step (every stream one token and its proposals) is
        timed for the cost model, with the keys its rows' attention reads."""
        if plan.num_tokens != len(plan.streams) + plan.num_drafts:
            self._shape = None
            return
        keys = 0
        for p in plan.streams:
            q = p.target - p.start
            keys += q * p.target - q * (q - 1) // 2
        self._shape = (plan.num_tokens, keys)

    def end_step(self, random_rows: int) -> None:
        """The step is done: a decode step's seconds train the cost model."""
        shape, self._shape = self._shape, None
        if shape is not None:
            self.policy.cost.observe(shape[0], shape[1], random_rows,
                                     time.perf_counter() - self._t0)

    # ---- reporting -----------------------------------------------------------------------
    def stats(self) -> dict[str, float | int]:
        d, t, a = self.drafts, self.draft_tokens, self.accepted_tokens
        out: dict[str, float | int] = {
            "spec_drafts": d,  # verifications (vLLM's num_drafts)
            "spec_draft_tokens": t,
            "spec_accepted_tokens": a,
            # vLLM's "draft acceptance rate": accepted / proposed tokens
            "spec_acceptance_rate": a / t if t else 0.0,
            # vLLM's "mean acceptance length" and SGLang's "accept length": tokens a
            # verification emits (accepted proposals plus the target's own token)
            "spec_mean_accepted_length": 1 + a / d if d else 0.0,
            "spec_steps": self.spec_steps,
            "spec_steps_off_batch": self.policy.off_batch,
            "spec_steps_off_cost": self.policy.off_cost,
            "spec_proposals_cut": self.proposals_cut,
        }
        for i, n in enumerate(self.accepted_at, start=1):
            out[f"spec_accepted_at_{i}"] = n
        return out


# calibrations made in this process, by engine settings: engines of the same model and
# settings in one process (offline runs, benches, tests) share the figures; each serving
# worker is its own process and measures its own
_CALIBRATED: dict[tuple[str, int], StepCost] = {}


def calibrate(engine: LLMEngine, k: int) -> StepCost:
    """Time the target's forward for each row count a step may reach, and one random row's
    sampling; the caches are left as new. The figures seed the cost model, which the engine's
    own steps then correct (`StepCost.observe`)."""
    cfg = engine.config
    key = (cfg.model_copy(update={"speculative_config": None}).model_dump_json(), k)
    got = _CALIBRATED.get(key)
    if got is not None:
        return StepCost(list(got.grid), list(got.lin_s), float(got.w[2]) * SAMPLE_SCALE)
    cost = _calibrate(engine, k)
    _CALIBRATED[key] = cost
    return StepCost(list(cost.grid), list(cost.lin_s), float(cost.w[2]) * SAMPLE_SCALE)


def _calibrate(engine: LLMEngine, k: int) -> StepCost:
    runner = engine.runner
    cfg = engine.config
    top = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * (k + 1), engine.max_model_len - 1,
              cfg.num_blocks * cfg.block_size)
    # the CPU linears change path past MAX_ROWS rows (exact: quantized blocks, then fp32
    # GEMM) and past 64 (int8: repacked weights' row-major path, then interleaved rows)
    from kvserve.workers.model.quant_linear import MAX_ROWS

    grid = sorted({t for t in [1, 2, 3, 4, 6, 8, 12, MAX_ROWS, MAX_ROWS + 1, 24, 32, 48, 64, 65, 96,
                               128, 192, 256, 384, 512, 768, 1024] if t <= top} | {top})
    seconds = runner.time_forward(grid)
    vocab = engine.model_config.vocab_size
    x = torch.randn(8, vocab, device=runner.device)
    from kvserve.sampling import SamplingParams

    params = [SamplingParams(temperature=0.8, top_p=0.95)] * 8
    sample_s = 0.0
    for _ in range(2):  # the second: warm
        t0 = time.perf_counter()
        engine.sampler.sample(x, params, [[1]] * 8, [[]] * 8, [None] * 8).result()
        sample_s = (time.perf_counter() - t0) / 8
    log.info("speculative decoding: forward of 1 / %d rows %.1f / %.1f ms; a random row's "
             "sampling %.2f ms", grid[-1], seconds[0] * 1e3, seconds[-1] * 1e3, sample_s * 1e3)
    return StepCost(grid, seconds, sample_s)


def stat_keys(k: int) -> list[str]:
    """The stats keys a speculating engine reports (for metrics and tests)."""
    return ["spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", *[
        f"spec_accepted_at_{i}" for i in range(1, k + 1)]]

