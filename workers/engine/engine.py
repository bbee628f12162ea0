"""LLMEngine: requests in, one scheduled step at a time, incremental outputs out."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from kvserve.config import EngineConfig
from kvserve.errors import InvalidRequestError, OutOfKVCacheError
from kvserve.models import resolve_model
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.workers.engine import constraints
from kvserve.workers.engine.sampler import Sampler, make_generator
from kvserve.workers.engine.scheduler import Scheduler
from kvserve.workers.engine.sequence import Sequence, Status
from kvserve.workers.loading.loader import load_model
from kvserve.workers.loading.tokenizer import Tokenizer, load_tokenizer
from kvserve.workers.model.runner import DTYPES, ModelRunner, Progress
from kvserve.workers.structured.grammars import Grammars

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: Progress | None = None) -> None:
        """`progress(state)` hears each stage of the start-up (loading, graph captures)."""
        self.config = config
        path = resolve_model(config.model)
        self.model_path = path
        if progress is not None:
            progress("loading")
        self.tokenizer: Tokenizer = load_tokenizer(path)
        loaded = load_model(path, dtype=DTYPES[config.resolved_dtype()])
        self.runner = ModelRunner(loaded, config, progress)
        self.model_config = loaded.config
        self.max_model_len = self.runner.max_model_len
        self.kv = self.runner.kv
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens,
            config.preemption_policy, config.admission_lookahead_tokens,
            config.max_evictions_per_request,
        )
        self.sampler = Sampler(config.seed)
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

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError / OutOfKVCacheError.

        `priority`: lower values are scheduled first; equal priorities are FCFS.
        """
        seq = self.make_sequence(prompt, params, request_id, priority)
        self.add_sequence(seq)
        return seq.request_id

    def make_sequence(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Sequence:
        """Validate and tokenize without touching the scheduler (safe from any thread)."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        ids, text = self._tokenize_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                "tokens and at least one must be left for the output"
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
        # a stream can never outgrow the pool: cap its length there (finish "length")
        cap = self.max_model_len
        if window is None:
            cap = min(cap, self.kv.num_blocks * self.kv.block_size)
        seq = Sequence(
            request_id, text, ids, params, self.tokenizer, gen, cap, next(self._arrival), priority
        )
        if grammar is not None:
            seq.grammar, seq.guided = grammar, True
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

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
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; return an output for every request that produced tokens or finished.

        `finished_only`: outputs for finished requests only (callers that never stream skip
        building one per running request per step).
        """
        plan, seqs = self.scheduler.schedule()
        if plan is None:
            return []
        logits = self.runner.run(plan)
        # per-stream host work below runs for every stream every step: keep it to a few
        # attribute reads and one output each
        rows: list[int] = []
        sample_seqs: list[Sequence] = []
        computed = 0
        guided = False
        for i, (s, p) in enumerate(zip(seqs, plan.streams, strict=True)):
            computed += p.target - p.start
            if p.is_new:
                self._account_admission(s, p.start, p.host_tokens)
            if p.target == len(s.prompt_ids) + len(s.output_ids):
                rows.append(i)
                sample_seqs.append(s)
                guided = guided or s.guided
        self.prompt_tokens_computed += computed
        outputs: list[RequestOutput] = []
        if not rows:
            return outputs
        sel = logits if len(rows) == len(seqs) else logits[torch.tensor(rows, device=logits.device)]
        if guided:  # logit_bias and grammar masks, on the constrained rows only
            constraints.apply(sel, sample_seqs, self.grammars)
        res = self.sampler(
            sel,
            [s.params for s in sample_seqs],
            [s.prompt_ids for s in sample_seqs],
            [s.output_ids for s in sample_seqs],
            [s.generator for s in sample_seqs],
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        lps, tops = res.logprobs, res.top_logprobs
        finished: list[Sequence] = []
        done = Status.FINISHED
        if guided:
            constraints.accept(sample_seqs, res.token_ids)
        for j, (s, tok) in enumerate(zip(sample_seqs, res.token_ids, strict=True)):
            s.append(tok, None if lps is None else lps[j], None if tops is None else tops[j])
            if s.status is done:
                finished.append(s)
                self.seqs.pop(s.request_id, None)
                outputs.append(s.to_output(1))
            elif finished_only:
                s.skip_delta()  # the final output's delta stays what streaming would show
            else:
                outputs.append(s.to_output(1))
        self.generated_tokens += len(sample_seqs)
        if finished:
            self.scheduler.finish(finished)
        return outputs

    def _account_admission(self, s: Sequence, start: int, host_tokens: int) -> None:
        parked = s.parked_kv
        if parked is None:
            self.host_prefix_hit_tokens += host_tokens
            return
        self.restores += 1
        self.tokens_restored_copy += host_tokens
        self.tokens_restored_device += min(start, parked.num_tokens) - host_tokens
        self.tokens_recomputed += max(0, parked.num_tokens - start)
        self.scheduler.release_parked(s)  # the copies ran: its host blocks are unpinned

    # ---- parked-stream snapshots ---------------------------------------------------------
    def export_stream(self, request_id: str) -> bytes:
        """Park an unfinished request and hand it over as a msgpack snapshot; it leaves
        this engine (its blocks here are freed)."""
        from kvserve.workers.engine.snapshot import export_stream

        return export_stream(self, request_id)

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
        bpb = self.runner.cache.bytes_per_block
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_used": self.kv.pool.num_used,
            "kv_blocks_free": self.kv.num_free_blocks,
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
            "host_prefix_hit_tokens": self.host_prefix_hit_tokens,
            "copy_bytes": host.copier.bytes_copied if host else 0,
            "copy_gbps": host.copier.gbps() if host else 0.0,
            # host -> device copies: parked streams restored and host prefix hits
            "restored_blocks": host.copier.blocks["in"] if host else 0,
            "restored_bytes": host.copier.blocks["in"] * bpb if host else 0,
            "copy_seconds_d2h": host.copier.seconds["out"] if host else 0.0,
            "copy_seconds_h2d": host.copier.seconds["in"] if host else 0.0,
            **self.grammars.stats(),
        }

    def held_block_hashes(self) -> dict[str, list[int]]:
        """Chained hashes of the prefix blocks this engine can serve from cache, per tier.

        Read by the router (through the worker actor) for KV-affinity routing; the host
        tier's hashes go in "host". Safe to call from another thread than the step loop.
        """
        host = self.kv.host
        return {"device": _snapshot_keys(self.kv.pool.cached),
                "host": _snapshot_keys(host.table.cached) if host is not None else []}


def _snapshot_keys(table: dict[int, int]) -> list[int]:
    for _ in range(10):
        try:  # the step thread may register/drop hashes while we copy
            return list(table)
        except RuntimeError:
            continue
    return []
