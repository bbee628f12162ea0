"""LLMEngine: requests in, one scheduled step at a time, incremental outputs out.

With asynchronous scheduling (`EngineConfig.async_scheduling`) a step is planned and
launched before the previous step's sampled ids reach the host: those stay on the device as
the new step's inputs, and the previous step's tokens are appended, checked for stops and
detokenized while the new step runs, so `step()` returns the outputs one step behind. A
stream that finished with them is not sampled in the new step and its KV is freed after it.
"""

from __future__ import annotations

import collections.abc
import itertools
import logging
import operator
import time

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.errors import InvalidRequestError, NotFoundError, OutOfKVCacheError
from kvserve.kvcache.manager import StepPlan
from kvserve.kvcache.restore_cost import DECISIONS, RestoreCost, stat_key
from kvserve.models import resolve_model
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.workers.engine import constraints
from kvserve.workers.engine.adapters import Adapter, AdapterManager
from kvserve.workers.engine.sampler import SampledBatch, Sampler, SamplerOutput, make_generator
from kvserve.workers.engine.scheduler import Scheduler
from kvserve.workers.engine.sequence import Sequence, Status
from kvserve.workers.engine.speculative import Speculator
from kvserve.workers.loading.loader import load_model, read_model_config
from kvserve.workers.loading.sharding import check_tensor_parallel
from kvserve.workers.loading.tokenizer import Tokenizer, load_tokenizer
from kvserve.workers.model.parallel.ranks import ShardRanks
from kvserve.workers.model.runner import (
    DTYPES,
    DeviceTokens,
    ModelRunner,
    Progress,
    context_limit,
)
from kvserve.workers.structured.grammars import Grammars

log = logging.getLogger(__name__)
_GUIDED = operator.attrgetter("guided")  # a stream whose logits are biased or masked


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: Progress | None = None) -> None:
        """`progress(state)` hears each stage of the start-up (loading, graph captures)."""
        self.config = config
        path = resolve_model(config.model)
        self.model_path = path
        # a max_model_len the KV pool cannot hold is refused before the weights load
        context_limit(read_model_config(path), config)
        if progress is not None:
            progress("loading")
        self.tokenizer: Tokenizer = load_tokenizer(path)
        self.runner = _start_runner(path, config, progress)
        self.model_config = self.runner.model_config
        # the usable context: the model's, or less where the device KV pool holds less
        self.max_model_len = context_limit(self.model_config, config)
        self.kv = self.runner.kv
        # LoRA adapters: registered by name, cached in host memory, in the runner's slots
        self.adapters: AdapterManager | None = None
        if self.runner.lora is not None:
            self.adapters = AdapterManager(self.runner.lora, self.model_config, config.cpu_loras,
                                           self.runner.dtype)
            for name, source in config.loras.items():
                self.add_lora(name, source)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens,
            config.preemption_policy, config.admission_lookahead_tokens,
            config.max_evictions_per_request, self.adapters,
        )
        self.sampler = Sampler(config.seed)
        self.async_scheduling = config.resolved_async_scheduling()
        # the launched step whose ids are still on the device: its sampled streams and ids
        self._inflight: tuple[list[Sequence], SampledBatch] | None = None
        self._carry: list[RequestOutput] = []  # outputs of a step resolved between steps
        # structured outputs: the grammar engine and its compiled-grammar cache, made on the
        # first constrained request
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self._ids = itertools.count()
        self.generated_tokens = 0
        self.prompt_tokens_computed = 0
        self._t0 = time.monotonic()
        # host tier accounting (tokens)
        self.restores = 0  # parked streams brought back
        self.tokens_restored_copy = 0  # served from host by copy on restore
        self.tokens_restored_device = 0  # still in the device prefix cache on restore
        self.tokens_recomputed = 0  # computed before eviction, computed again after
        self.host_prefix_hit_tokens = 0  # new requests' prompt tokens served from host
        # how parked streams came back: by copy or recomputed, and why (restore_cost.DECISIONS)
        self.restore_decisions = {stat_key(d, r): 0 for d, r in DECISIONS}
        # speculative decoding: proposals before each step, verified in it
        self.spec: Speculator | None = None
        if config.speculative_config is not None:
            if progress is not None:
                progress("calibrating speculative decoding")
            self.spec = Speculator(config.speculative_config, self)

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError / OutOfKVCacheError, and
        NotFoundError for an unknown LoRA adapter.

        `priority`: lower values are scheduled first; equal priorities are FCFS.
        `lora`: the name of a loaded LoRA adapter to generate with (None: the base model).
        """
        seq = self.make_sequence(prompt, params, request_id, priority, lora)
        self.add_sequence(seq)
        return seq.request_id

    def make_sequence(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora: str | Adapter | None = None,
    ) -> Sequence:
        """Validate and tokenize without touching the scheduler (safe from any thread). A
        request of a LoRA adapter holds the adapter's host copy from here until it leaves
        (read from disk here if it was dropped from host memory)."""
        params = params or SamplingParams()
        adapter = self.resolve_lora(lora) if isinstance(lora, str) else lora
        request_id = request_id or f"req-{next(self._ids)}"
        ids, text = self._tokenize_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context is {self.max_model_len} tokens "
                f"({self._context_source()}) and at least one must be left for the output"
            )
        # a stream holds its whole KV, or with every layer windowed the window and one chunk
        window = self.kv.window
        held = len(ids) + 1
        if window is not None:
            held = min(held, window + self.config.max_num_batched_tokens)
        if self.kv.blocks_needed(held) + (window is not None) > self.kv.num_blocks:
            raise OutOfKVCacheError(
                f"prompt of {len(ids)} tokens needs {self.kv.blocks_needed(held)} KV "
                f"blocks; the cache holds {self.kv.num_blocks} "
                f"(kv_cache_tokens={self.config.kv_cache_tokens})"
            )
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias names token {max(params.logit_bias)}, outside "
                                      f"the vocabulary (0..{vocab - 1})")
        # compiled here, off the step thread (cached by the spec's text)
        grammar = self.grammars.state(params.structured) if params.structured else None
        gen = make_generator(params.seed, self.runner.device)
        # the context limit already keeps a stream within the pool (context_limit)
        seq = Sequence(
            request_id, text, ids, params, self.tokenizer, gen, self.max_model_len,
            next(self._arrival), priority,
        )
        if adapter is not None:
            assert self.adapters is not None
            self.adapters.pin(adapter)
            seq.lora, seq.lora_pinned, seq.kv_step.root = adapter, True, adapter.root
        if grammar is not None:
            seq.grammar, seq.guided = grammar, True
        return seq

    def _context_source(self) -> str:
        model_len = self.runner.max_model_len
        if self.max_model_len < model_len:
            return (f"what this engine's KV pool holds for one stream; the model's own is "
                    f"{model_len}")
        return "the model's" if self.config.max_model_len is None else "max_model_len"

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            self.discard(seq)
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def discard(self, seq: Sequence) -> None:
        """Drop a sequence that was made but never queued (what it holds is let go)."""
        self.scheduler.leave(seq)

    # ---- LoRA adapters -------------------------------------------------------------------
    def resolve_lora(self, name: str) -> Adapter:
        """The loaded adapter `name` (NotFoundError when there is none)."""
        if self.adapters is None:
            raise NotFoundError(f"no LoRA adapter named {name!r}: this engine serves no LoRA "
                                "adapters (enable_lora)")
        return self.adapters.resolve(name)

    def add_lora(self, name: str, source: str) -> dict:
        """Load a PEFT adapter (a directory, or a Hub id fetched into HF's cache) under
        `name`; AdapterError when it cannot be served (nothing kept), the same adapter again
        is a no-op. Any thread: the disk read does not hold up steps."""
        if self.adapters is None:
            raise InvalidRequestError("LoRA adapters are not enabled on this engine "
                                      "(enable_lora, or --lora / --enable-lora when serving)")
        from kvserve.models import resolve_adapter

        ad = self.adapters.add(name, resolve_adapter(source), source)
        return {"name": ad.name, "source": ad.source, "rank": ad.rank, "modules": list(ad.modules),
                "root": ad.root}

    def remove_lora(self, name: str) -> None:
        """Unload `name`: new requests cannot name it; its running ones finish with it."""
        if self.adapters is None:
            raise NotFoundError(f"no LoRA adapter named {name!r} is loaded")
        self.adapters.remove(name)

    def list_loras(self) -> list[dict]:
        return self.adapters.listing() if self.adapters is not None else []

    def _lora_rows(self, seqs: list[Sequence]) -> np.ndarray | None:
        """Each planned stream's adapter slot, or None when the step has no adapter."""
        if self.adapters is None:
            return None
        rows = np.fromiter((s.lora_slot for s in seqs), np.int64, len(seqs))
        return rows if (rows >= 0).any() else None

    def _tokenize_prompt(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return self.tokenizer.encode(prompt), prompt
        if not isinstance(prompt, list | tuple) or not prompt:
            raise InvalidRequestError("prompt must be a non-empty string or list of token ids")
        vocab = self.model_config.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt token id {t!r} is outside the vocabulary (0..{vocab - 1})")
        return list(prompt), None

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks at once (also mid-prefill)."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.abort()
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.forget([request_id])
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._carry)

    # ---- stepping ------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; return an output for every request that produced tokens or finished
        (under asynchronous scheduling: in the step before).

        `finished_only`: outputs for finished requests only (callers that never stream skip
        building one per running request per step).
        """
        if self.async_scheduling:
            return self._step_async(finished_only)
        spec = self.spec
        if spec is not None:
            spec.propose()
        plan, seqs = self.scheduler.schedule()
        if plan is None:
            return []
        if spec is not None:
            spec.planned(plan)
            if plan.num_drafts:
                return self._step_verify(plan, seqs, finished_only)
        logits = self.runner.run(plan, lora=self._lora_rows(seqs))
        rows, sample_seqs = self._sampling_rows(plan, seqs)
        if not rows:
            return []
        outputs, finished = self._append(sample_seqs, self._sample(logits, rows, sample_seqs).result(),
                                         finished_only)
        if finished:
            self.scheduler.finish(finished)
        if spec is not None:
            if finished:
                spec.forget([s.request_id for s in finished])
            spec.end_step(sum(not s.params.greedy for s in sample_seqs))
        return outputs

    def _step_verify(self, plan: StepPlan, seqs: list[Sequence],
                     finished_only: bool) -> list[RequestOutput]:
        """A step with proposals: the forward, then their verification (the rejected ones'
        KV rolled back) before the commit, then every stream's emitted tokens."""
        spec = self.spec
        assert spec is not None
        logits = self.runner.launch(plan)
        rows, sample_seqs = self._sampling_rows(plan, seqs)
        try:
            emitted = spec.verify(plan, rows, sample_seqs, logits)
        except BaseException:
            self.kv.rollback(plan)
            raise
        self.kv.commit(plan)
        outputs, finished = self._append_tokens(sample_seqs, emitted, finished_only)
        if finished:
            self.scheduler.finish(finished)
            spec.forget([s.request_id for s in finished])
        spec.end_step(sum((len(s.kv_step.draft) + 1) * (not s.params.greedy) for s in sample_seqs))
        return outputs

    def _append_tokens(self, seqs: list[Sequence], emitted: list[tuple[list[int], list[float] | None,
                                                                      list[list[tuple[int, float]]] | None]],
                       finished_only: bool) -> tuple[list[RequestOutput], list[Sequence]]:
        """Add each stream's tokens of a verifying step in order, up to the one that ends it
        (stop id, stop string, length), and build one output per stream."""
        outputs: list[RequestOutput] = []
        finished: list[Sequence] = []
        made = 0
        for s, (toks, lps, tops) in zip(seqs, emitted, strict=True):
            g = s.grammar
            n = 0
            for m, tok in enumerate(toks):
                if g is not None and not g.accept(tok):
                    g.broken = True  # the mask allowed only tokens the grammar takes: a bug
                s.append(tok, None if lps is None else lps[m], None if tops is None else tops[m])
                n += 1
                if s.finish_reason is not None:
                    break
            made += n
            if s.finish_reason is not None:
                finished.append(s)
                outputs.append(s.to_output(n))
            elif finished_only:
                s.skip_delta()
            else:
                outputs.append(s.to_output(n))
        for s in finished:
            self.seqs.pop(s.request_id, None)
        self.generated_tokens += made
        return outputs, finished

    def _step_async(self, finished_only: bool) -> list[RequestOutput]:
        """Plan and launch step N+1, then append step N's tokens (the wait is for step N's
        ids only), then sample step N+1 with every stream's tokens up to date (penalties and
        min_tokens see them) and commit it."""
        outputs, self._carry = self._carry, []
        plan, seqs = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        logits = None
        if plan is not None:
            dev = None
            if prev is not None:
                idx = [i for i, s in enumerate(seqs) if s.inflight_row >= 0]
                if idx:
                    dev = DeviceTokens(np.array(idx), np.array([seqs[i].inflight_row for i in idx]),
                                       prev[1].tokens)
            try:
                logits = self.runner.launch(plan, dev, self._lora_rows(seqs))
            except BaseException:
                self._inflight = prev  # its tokens are still to be appended
                raise
        finished: list[Sequence] = []
        if prev is not None:
            outs, finished = self._resolve(prev, finished_only)
            outputs += outs
        if plan is not None:
            assert logits is not None
            rows, sample_seqs = self._sampling_rows(plan, seqs, bool(finished))
            if rows:
                sampled = self._sample(logits, rows, sample_seqs)
                for j, s in enumerate(sample_seqs):
                    s.inflight_row = j
                self._inflight = (sample_seqs, sampled)
            self.kv.commit(plan)
        if finished:
            self.scheduler.finish(finished)  # after the commit: their KV was in this step
        return outputs

    def _resolve(self, batch: tuple[list[Sequence], SampledBatch],
                 finished_only: bool) -> tuple[list[RequestOutput], list[Sequence]]:
        """Append a launched step's tokens (waiting for its ids); streams aborted since drop
        theirs."""
        seqs, sampled = batch
        res = sampled.result()
        live = [s.status is not Status.FINISHED for s in seqs]
        for s in seqs:
            s.inflight_row = -1
        if all(live):
            return self._append(seqs, res, finished_only)
        keep = [j for j, ok in enumerate(live) if ok]
        lps, tops = res.logprobs, res.top_logprobs
        res.token_ids = [res.token_ids[j] for j in keep]
        res.logprobs = None if lps is None else [lps[j] for j in keep]
        res.top_logprobs = None if tops is None else [tops[j] for j in keep]
        return self._append([seqs[j] for j in keep], res, finished_only)

    @property
    def step_in_flight(self) -> bool:
        """A launched step's tokens are not appended yet (asynchronous scheduling)."""
        return self._inflight is not None

    def flush(self) -> list[RequestOutput]:
        """Append the tokens of a launched step now and return their outputs: every stream's
        state is then whole, as a snapshot needs it (asynchronous scheduling; else [])."""
        prev, self._inflight = self._inflight, None
        if prev is None:
            return []
        outs, finished = self._resolve(prev, False)
        if finished:
            self.scheduler.finish(finished)
        return outs

    def _sampling_rows(self, plan: StepPlan, seqs: list[Sequence],
                       finished: bool = False) -> tuple[list[int], list[Sequence]]:
        """The logits rows to sample: streams whose step reached their last known token (the
        scheduler marked them), less any that finished meanwhile; admissions are accounted."""
        sched = self.scheduler
        first = sched.first_new
        for s, p in zip(seqs[first:], plan.streams[first:], strict=True):
            self._account_admission(s, p.start, p.host_tokens)
        self.prompt_tokens_computed += plan.num_tokens
        rows = sched.sampled
        if rows is None:
            rows, sample_seqs = list(range(len(seqs))), seqs
        else:
            sample_seqs = [seqs[i] for i in rows]
        if finished:  # asynchronous: some streams finished with the last step's tokens
            keep = [j for j, s in enumerate(sample_seqs) if s.finish_reason is None]
            if len(keep) < len(rows):
                rows = [rows[j] for j in keep]
                sample_seqs = [sample_seqs[j] for j in keep]
        return rows, sample_seqs

    def _sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> SampledBatch:
        sel = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
        # logit_bias and grammar masks, on the constrained rows only. A grammar has accepted
        # every token before its mask is built: under asynchronous scheduling the step before
        # was appended (`_resolve`) before this step is sampled.
        if any(map(_GUIDED, seqs)):
            constraints.apply(sel, seqs, self.grammars)
        # the sampler reads prompts, outputs and generators only for the rows that need them
        return self.sampler.sample(
            sel,
            [s.params for s in seqs],
            _Column(seqs, "prompt_ids"),
            _Column(seqs, "output_ids"),
            _Column(seqs, "generator"),
            eos_token_ids=self.tokenizer.eos_token_ids,
        )

    def _append(self, seqs: list[Sequence], res: SamplerOutput,
                finished_only: bool) -> tuple[list[RequestOutput], list[Sequence]]:
        """Add each stream's sampled token (stop checks, detokenization) and build outputs."""
        lps, tops = res.logprobs, res.top_logprobs
        outputs: list[RequestOutput] = []
        finished: list[Sequence] = []
        if any(map(_GUIDED, seqs)):
            constraints.accept(seqs, res.token_ids)
        # once per stream per step: no enumerate, no per-item conditionals when no logprobs
        if lps is None and tops is None and not finished_only:
            for s, tok in zip(seqs, res.token_ids, strict=True):
                o = s.emit(tok)
                outputs.append(o)
                if o.finish_reason is not None:
                    finished.append(s)
        elif lps is None and tops is None:
            for s, tok in zip(seqs, res.token_ids, strict=True):
                s.append(tok, None, None)
                if s.finish_reason is not None:
                    finished.append(s)
                    outputs.append(s.to_output(1))
                else:
                    s.skip_delta()  # the final output's delta stays what streaming would show
        else:
            for j, (s, tok) in enumerate(zip(seqs, res.token_ids, strict=True)):
                s.append(tok, None if lps is None else lps[j], None if tops is None else tops[j])
                if s.finish_reason is not None:
                    finished.append(s)
                    outputs.append(s.to_output(1))
                elif finished_only:
                    s.skip_delta()
                else:
                    outputs.append(s.to_output(1))
        for s in finished:
            self.seqs.pop(s.request_id, None)
        self.generated_tokens += len(seqs)
        return outputs, finished

    def _account_admission(self, s: Sequence, start: int, host_tokens: int) -> None:
        parked = s.parked_kv
        if parked is None:
            self.host_prefix_hit_tokens += host_tokens
            return
        self.restores += 1
        recomputed = max(0, parked.num_tokens - start)
        self.tokens_restored_copy += host_tokens
        self.tokens_restored_device += min(start, parked.num_tokens) - host_tokens
        self.tokens_recomputed += recomputed
        choice, s.restore_choice = s.restore_choice, None
        if host_tokens:
            assert choice is not None and choice.copy
            self.restore_decisions[stat_key("copy", choice.reason)] += 1
        elif recomputed:  # (a stream whose KV all stayed on the device needed no choice)
            reason = choice.reason if choice is not None and not choice.copy else "not_on_host"
            self.restore_decisions[stat_key("recompute", reason)] += 1
        self.scheduler.release_parked(s)  # the copies ran: its host blocks are unpinned

    # ---- parked-stream snapshots ---------------------------------------------------------
    def export_stream(self, request_id: str) -> bytes:
        """Park an unfinished request and hand it over as a msgpack snapshot; it leaves
        this engine (its blocks here are freed)."""
        from kvserve.workers.engine.snapshot import export_stream

        self._carry += self.flush()  # its last token belongs in the snapshot; its output
        # comes with the next step()
        data = export_stream(self, request_id)
        if self.spec is not None:
            self.spec.forget([request_id])
        return data

    def import_stream(self, data: bytes, request_id: str | None = None) -> str:
        """Queue a snapshot from `export_stream` (this or another engine, same model) as a
        parked stream; its output continues where it stopped."""
        from kvserve.workers.engine.snapshot import import_stream

        return import_stream(self, data, request_id)

    def check_invariants(self) -> None:
        """Device and host bookkeeping agree with the streams (tests, debugging)."""
        self.kv.check_invariants()
        host = self.kv.host
        if host is not None:
            pins = [s.parked_kv for s in self.seqs.values() if s.parked_kv is not None]
            host.check_invariants(pins)

    def stats(self) -> dict[str, float | int]:
        elapsed = max(1e-9, time.monotonic() - self._t0)
        host = self.kv.host
        bpb = self.runner.bytes_per_block  # over every rank of a tensor-parallel engine
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_used": self.kv.pool.num_used,
            "kv_blocks_free": self.kv.num_free_blocks,
            "kv_blocks_reserved": sum(len(b) for b in self.kv.reserved.values()),  # live moves
            "kv_blocks_dropped": self.kv.blocks_dropped,  # released by sliding windows
            "prefix_cache_hit_rate": self.kv.prefix_hit_rate(),
            "generation_tokens_per_s": self.generated_tokens / elapsed,
            "kv_bytes_used": self.kv.pool.num_used * bpb,
            "host_blocks_total": host.num_blocks if host else 0,
            "host_blocks_used": host.num_used if host else 0,  # pinned by parked streams
            "host_blocks_cached": host.num_cached() if host else 0,
            "host_bytes_used": (host.num_used if host else 0) * bpb,
            "host_bytes_cached": (host.num_cached() if host else 0) * bpb,
            "host_evictions": host.evictions if host else 0,
            "parked": len(self.scheduler.parked),
            "evictions": self.scheduler.num_preemptions,
            "evictions_over_cap": self.scheduler.evictions_over_cap,
            "restores": self.restores,
            "tokens_restored_copy": self.tokens_restored_copy,
            "tokens_restored_device": self.tokens_restored_device,
            "tokens_recomputed": self.tokens_recomputed,
            # every token the model ran (prompts, decode steps, recomputes): a decode worker's
            # hand-offs add only their decode steps
            "tokens_computed": self.prompt_tokens_computed,
            "host_prefix_hit_tokens": self.host_prefix_hit_tokens,
            "copy_bytes": host.copier.bytes_copied if host else 0,
            "copy_gbps": host.copier.gbps() if host else 0.0,
            # host -> device copies: parked streams restored and host prefix hits
            "restored_blocks": host.copier.blocks["in"] if host else 0,
            "restored_bytes": host.copier.blocks["in"] * bpb if host else 0,
            "copy_seconds_d2h": host.copier.seconds["out"] if host else 0.0,
            "copy_seconds_h2d": host.copier.seconds["in"] if host else 0.0,
            # the restore cost model: measured copy bandwidth and latency, prefill rate
            **(host.cost if host else RestoreCost(1.0)).figures(),
            "restores_copy": sum(v for k, v in self.restore_decisions.items()
                                 if k.startswith("restores_copy_")),
            "restores_recompute": sum(v for k, v in self.restore_decisions.items()
                                      if k.startswith("restores_recompute_")),
            **self.restore_decisions,
            "writebacks_skipped": self.scheduler.writebacks_skipped,
            "demotions_skipped": host.demotions_skipped if host else 0,
            **self.grammars.stats(),
            **self.runner.parallel_stats(),
            **(self.spec.stats() if self.spec is not None else {}),
            **(self.adapters.stats() if self.adapters is not None else {}),
        }

    def held_block_hashes(self) -> dict[str, list[int]]:
        """Chained hashes of the prefix blocks this engine can serve from cache, per tier.

        Read by the router (through the worker actor) for KV-affinity routing; the host
        tier's hashes go in "host". Safe to call from another thread than the step loop.
        """
        host = self.kv.host
        return {"device": _snapshot_keys(self.kv.pool.cached),
                "host": _snapshot_keys(host.table.cached) if host is not None else []}


    def shard_pids(self) -> list[int]:
        """The processes of a tensor-parallel engine's ranks 1..N-1 ([] on one device)."""
        ranks = self.runner.ranks
        return ranks.pids if ranks is not None else []

    def close(self) -> None:
        """Release what outlives the engine object: a tensor-parallel engine's other ranks
        (their processes end here)."""
        self.runner.close()


def _start_runner(path: str, config: EngineConfig, progress: Progress | None) -> ModelRunner:
    """The model runner; a tensor-parallel one's other ranks start first and load their
    shards while rank 0 loads its own."""
    dtype = DTYPES[config.resolved_dtype()]
    if config.tensor_parallel_size == 1:
        return ModelRunner(load_model(path, dtype=dtype), config, progress)
    # a size the model cannot split is refused before any rank starts
    check_tensor_parallel(read_model_config(path), config.tensor_parallel_size, path)
    ranks = ShardRanks(path, config)
    try:
        loaded = load_model(path, dtype=dtype, shard=ranks.shard(0))
        ranks.wait_ready()
        return ModelRunner(loaded, config, progress, ranks)
    except BaseException:
        ranks.close()
        raise


class _Column(collections.abc.Sequence):
    """One attribute of every sequence, read when indexed (not gathered up front)."""

    def __init__(self, seqs: list[Sequence], name: str) -> None:
        self.seqs, self.get = seqs, operator.attrgetter(name)

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self.get(s) for s in self.seqs[i]]
        return self.get(self.seqs[i])

    def __iter__(self):
        return map(self.get, self.seqs)


def _snapshot_keys(table: dict[int, int]) -> list[int]:
    for _ in range(10):
        try:  # the step thread may register/drop hashes while we copy
            return list(table)
        except RuntimeError:
            continue
    return []
