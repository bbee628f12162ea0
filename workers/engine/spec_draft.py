"""The draft-model proposer: a smaller model that shares the target's tokenizer proposes each
speculating stream's next tokens, one forward per proposed position, over its own paged KV.

Its streams follow the target's by request id. Before proposing, a stream's draft KV is cut
back to the tokens the target accepted (`DraftRunner` / `KVCacheManager.truncate`) and
caught up with the ones it has not seen (the prompt on its first step, then the accepted
proposals and the target's own token, in chunks within the step's token budget); then each
position is drawn as the target's row at that position will be drawn (`Speculator._choose_draft`:
same penalties, bans, bias, grammar and noise), so where the two models agree the proposal is
the target's token. Streams that leave the target's batch (finished, parked, moved) leave the
draft's pool too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.errors import ConfigError
from kvserve.kvcache.manager import KVCacheFull, StreamStep
from kvserve.models import resolve_model
from kvserve.workers.loading.loader import load_model
from kvserve.workers.loading.tokenizer import load_tokenizer
from kvserve.workers.model.draft_runner import DraftRunner
from kvserve.workers.model.forward import DTYPES

if TYPE_CHECKING:
    from kvserve.workers.engine.engine import LLMEngine
    from kvserve.workers.engine.sequence import Sequence

log = logging.getLogger(__name__)

Choose = Callable[[torch.Tensor, list["Sequence"], list[list[int]], list[torch.Generator | None]],
                  list[int]]


# a draft's forward seconds per row count, by draft and engine settings (this process)
_TIMED: dict[tuple[str, str], list[float]] = {}


class DraftModelProposer:
    name = "draft_model"
    free = False

    def __init__(self, model: str, engine: LLMEngine, choose: Choose) -> None:
        cfg = engine.config
        path = resolve_model(model)
        loaded = load_model(path, dtype=DTYPES[cfg.resolved_dtype()])
        vocab = engine.model_config.vocab_size
        if loaded.config.vocab_size != vocab:
            raise ConfigError(f"the draft model {model!r} has a vocabulary of "
                              f"{loaded.config.vocab_size} tokens, the target {vocab}: a draft "
                              "must share the target's tokenizer")
        if load_tokenizer(path).backend.get_vocab() != engine.tokenizer.backend.get_vocab():
            raise ConfigError(f"the draft model {model!r} does not share the target's tokenizer")
        self.runner = DraftRunner(loaded, cfg, engine.max_model_len)
        self.choose = choose
        self.budget = cfg.max_num_batched_tokens
        self.eos = set(engine.tokenizer.eos_token_ids)
        # per stream: its length when it last proposed, and those proposals (what its draft
        # KV holds past that length)
        self.proposed: dict[str, tuple[int, list[int]]] = {}
        top = max(1, min(cfg.max_num_seqs * 2, self.budget))
        self.grid = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= top} | {top})
        key = (model, cfg.model_copy(update={"speculative_config": None}).model_dump_json())
        if key not in _TIMED:  # as the target's calibration: once per process and settings
            _TIMED[key] = self.runner.time_rows(self.grid, vocab)
        self.seconds = _TIMED[key]
        log.info("draft model %s: a forward of 1 / %d rows %.1f / %.1f ms", model, self.grid[-1],
                 self.seconds[0] * 1e3, self.seconds[-1] * 1e3)

    def step_seconds(self, rows: list[int]) -> float:
        """Its forwards for `rows[j]` streams' j+1-th proposal (the first catches the streams
        up: about two tokens each)."""
        g, s = self.grid, self.seconds
        total = 0.0
        for j, n in enumerate(rows):
            if n:
                total += float(np.interp(2 * n if j == 0 else n, g, s))
        return total

    def keep_only(self, live: set[str]) -> None:
        kv = self.runner.kv
        for sid in [sid for sid in kv.streams if sid not in live]:
            kv.free(sid)
            self.proposed.pop(sid, None)

    def _sync(self, s: Sequence) -> int:
        """Cut the stream's draft KV back to the tokens it shares with the stream; the
        tokens it holds KV for."""
        kv = self.runner.kv
        sid = s.request_id
        if not kv.has_stream(sid):
            return 0
        done = kv.num_computed(sid)
        base, tail = self.proposed.pop(sid, (done, []))
        ids = s.all_ids
        keep = min(done, base)
        for t in tail[: done - base]:
            if keep >= len(ids) or ids[keep] != t:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # the last token's logits are wanted: computed again
        kv.truncate(sid, keep)
        return keep

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        kv = self.runner.kv
        out: list[list[int]] = [[] for _ in seqs]
        budget = self.budget
        live: list[int] = []
        steps: list[StreamStep] = []
        for j, s in enumerate(seqs):
            have = self._sync(s)
            n = len(s.all_ids) - have
            if n > budget:  # a long catch-up: a chunk now, proposals from a later step
                if budget > 0:
                    steps.append(StreamStep(s.request_id, s.all_ids, have + budget))
                budget = 0
                continue
            budget -= n
            steps.append(StreamStep(s.request_id, s.all_ids, len(s.all_ids)))
            live.append(j)
        if not steps:
            return out
        try:
            logits = self.runner.run(steps)
        except KVCacheFull:
            self.keep_only({st.stream_id for st in steps})
            try:
                logits = self.runner.run(steps)
            except KVCacheFull:
                return out  # no room in the draft's pool this step
        rows = {st.stream_id: i for i, st in enumerate(steps)}
        logits = logits[torch.tensor([rows[seqs[j].request_id] for j in live], device=logits.device)]
        gens: list[torch.Generator | None] = []
        for j in live:
            s = seqs[j]
            src = s.generator if s.generator is not None else s.spec_gen
            if s.params.greedy or src is None:
                gens.append(None)
                continue
            g = torch.Generator(device=src.device)
            g.set_state(src.get_state())  # the noise the target's rows will draw
            gens.append(g)
        accepted = [0] * len(seqs)  # tokens each grammar took (rolled back at the end)
        try:
            while live:
                toks = self.choose(logits, [seqs[j] for j in live], [out[j] for j in live], gens)
                nxt, nxt_gens = [], []
                for r, (j, t) in enumerate(zip(live, toks, strict=True)):
                    s = seqs[j]
                    out[j].append(t)
                    g = s.grammar
                    if g is not None:
                        if not g.accept(t):
                            continue
                        accepted[j] += 1
                        if g.is_terminated():
                            continue
                    if t in self.eos or len(out[j]) >= ks[j]:
                        continue
                    nxt.append(j)
                    nxt_gens.append(gens[r])
                live, gens = nxt, nxt_gens
                if not live:
                    break
                logits = self.runner.run([StreamStep(seqs[j].request_id, seqs[j].all_ids + out[j],
                                                     len(seqs[j].all_ids) + len(out[j]))
                                          for j in live])
        except KVCacheFull:
            pass  # proposals so far stand
        finally:
            for j, n in enumerate(accepted):
                if n:
                    seqs[j].grammar.matcher.rollback(n)  # type: ignore[union-attr]
        for j, s in enumerate(seqs):
            if out[j] and kv.has_stream(s.request_id):
                self.proposed[s.request_id] = (len(s.all_ids), out[j])
        return out
