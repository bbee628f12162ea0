"""The grammar engine (xgrammar) over kvserve's tokenizer, with a compiled-grammar cache.

xgrammar was chosen over llguidance by measurement (docs/design.md, "Structured outputs"):
its per-step batched mask fill and its compiled bitmask kernels (CPU and CUDA) cost less
per step, which every constrained step pays; its larger compile cost is paid once per
schema, cached, and off the step thread.

- The tokenizer info is built from kvserve's own tokenizer (`vocab.py`: each token's bytes),
  on the first constrained request, with the end-of-sequence ids as stop tokens. Structural
  tags (strict functions' calls under `tool_choice: "auto"`) get a second one where the
  tokenizer has call markers as special tokens (`[TOOL_CALLS]`), which their token rules
  produce (`vocab.py`).
- `compile(spec)` goes through one LRU per process keyed by the tokenizer and the spec's
  text (engines of one model in a process share it); `state(spec)` gives a new stream its
  matcher.
- `check_spec(spec)` validates a spec without a tokenizer (building the grammar only,
  about a millisecond), so the ingress refuses a bad schema with a message that names it.
- `mask(logits, rows, states)` fills the masks of every constrained row in one batched call
  into a reused host bitmask and applies it to those rows, on the logits' device.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from kvserve.errors import InvalidRequestError
from kvserve.structured import StructuredOutput
from kvserve.workers.loading.tokenizer import Tokenizer
from kvserve.workers.structured.state import GrammarState
from kvserve.workers.structured.vocab import build_vocab, marker_tokens

CACHE_SIZE = 256
# The engine's own threads: compiles run beside the step loop, mask fills inside it.
COMPILE_THREADS = 2
FILL_THREADS = 2


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def _grammar(xgr: Any, spec: StructuredOutput) -> Any:
    """The spec as an xgrammar Grammar (no tokenizer needed)."""
    if spec.type == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)
    if spec.type == "json_schema":
        return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False,
                                            strict_mode=spec.strict)
    if spec.type == "regex":
        return xgr.Grammar.from_regex(spec.spec)
    if spec.type == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec.spec)
    return xgr.Grammar.from_ebnf(spec.spec, root_rule_name="root")


_WHAT = {"json_object": "JSON object", "json_schema": "JSON schema", "regex": "regular expression",
         "grammar": "GBNF grammar", "structural_tag": "functions' parameters schema"}


def _refusal(spec: StructuredOutput, e: Exception) -> InvalidRequestError:
    # xgrammar's messages start with "[time] file.cc:line: "; the rest names the problem
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "] " in msg and ".cc:" in msg:
        msg = msg.split(": ", 1)[-1]
    return InvalidRequestError(f"the {_WHAT[spec.type]} is not supported or not valid: {msg}")


def check_spec(spec: StructuredOutput) -> None:
    """Raise InvalidRequestError naming what is wrong with `spec` (unknown type, bad regex...)."""
    try:
        _grammar(_xgr(), spec)
    except Exception as e:
        raise _refusal(spec, e) from None


# Shared by every engine of the process: one compiler per tokenizer, and one LRU of
# compiled grammars keyed by the tokenizer and the spec's text.
_LOCK = threading.Lock()
_COMPILERS: dict[tuple, Any] = {}
_CACHE: OrderedDict[tuple, Any] = OrderedDict()


def clear_cache() -> None:
    with _LOCK:
        _CACHE.clear()


class Grammars:
    """One engine's view of the grammar engine: compiles (cached), its step bitmask, counters."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        # the tokenizer's identity: the file it came from and the logits' width
        self.key = (tokenizer.source, tokenizer.vocab_size, vocab_size)
        self._batch: Any = None
        self._bitmask: torch.Tensor | None = None  # host [rows, words], grown as needed
        self._device_bitmask: torch.Tensor | None = None
        # counters (engine stats)
        self.compiles = 0
        self.cache_hits = 0
        self.compile_s = 0.0

    def _compiler(self, spec: StructuredOutput | None = None) -> Any:
        spelled = frozenset(marker_tokens(self.tokenizer, self.vocab_size).values()) \
            if spec is not None and spec.type == "structural_tag" else frozenset()
        key = (*self.key, tuple(sorted(spelled)))
        with _LOCK:
            compiler = _COMPILERS.get(key)
            if compiler is None:
                xgr = _xgr()
                v = build_vocab(self.tokenizer, self.vocab_size, spelled)
                info = xgr.TokenizerInfo(v.tokens, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=v.eos_ids or None)
                compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS,
                                               cache_enabled=False)
                _COMPILERS[key] = compiler
            return compiler

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of `spec` (cached); InvalidRequestError for a bad spec."""
        key = (self.key, spec.key())
        with _LOCK:
            hit = _CACHE.get(key)
            if hit is not None:
                _CACHE.move_to_end(key)
                self.cache_hits += 1
                return hit
        compiler = self._compiler(spec)
        t0 = time.perf_counter()
        try:
            compiled = compiler.compile_grammar(_grammar(_xgr(), spec))
        except Exception as e:
            raise _refusal(spec, e) from None
        with _LOCK:
            self.compiles += 1
            self.compile_s += time.perf_counter() - t0
            _CACHE[key] = compiled
            while len(_CACHE) > self.cache_size:
                _CACHE.popitem(last=False)
        return compiled

    def state(self, spec: StructuredOutput) -> GrammarState:
        return GrammarState(spec, _xgr().GrammarMatcher(self.compile(spec)))

    def mask(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState],
             drafts: list[list[int]] | None = None) -> None:
        """Set the logits of tokens each row's grammar refuses to -inf, in place (rows only).

        `drafts` (speculative decoding): `rows[i]` starts `len(drafts[i]) + 1` consecutive
        rows, row j masked by the grammar after the first j proposals (each matcher walks its
        proposals and is rolled back)."""
        xgr = _xgr()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(FILL_THREADS)
        bm = self._host_bitmask(logits.shape[0])
        if drafts is not None and any(drafts):
            plain = [i for i, d in enumerate(drafts) if not d]
            if plain:
                self._batch.batch_fill_next_token_bitmask(
                    [states[i].matcher for i in plain], bm, [rows[i] for i in plain])
            every = []
            for r, st, d in zip(rows, states, drafts, strict=True):
                every.extend(range(r, r + len(d) + 1))
                if not d:
                    continue
                m = st.matcher
                for j in range(len(d) + 1):
                    m.fill_next_token_bitmask(bm, r + j)
                    if j < len(d) and not m.accept_token(d[j]):
                        raise RuntimeError("a proposal the grammar refused reached verification")
                m.rollback(len(d))
            rows = every
        else:
            self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], bm, rows)
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, bm, vocab_size=self.vocab_size,
                                            indices=rows, backend="cpu")
            return
        dev = self._device_bitmask
        if dev is None or dev.shape[0] < bm.shape[0] or dev.device != logits.device:
            dev = self._device_bitmask = torch.empty(bm.shape, dtype=torch.int32,
                                                     device=logits.device)
        dev = dev[: logits.shape[0]]
        dev.copy_(bm[: logits.shape[0]], non_blocking=True)  # pinned: no host wait
        xgr.apply_token_bitmask_inplace(logits, dev, vocab_size=self.vocab_size, indices=rows)

    def _host_bitmask(self, n: int) -> torch.Tensor:
        bm = self._bitmask
        if bm is None or bm.shape[0] < n:
            words = (self.vocab_size + 31) // 32
            bm = torch.empty((max(n, 8), words), dtype=torch.int32,
                             pin_memory=torch.cuda.is_available())
            self._bitmask = bm
        return bm[:n]

    def stats(self) -> dict[str, float | int]:
        return {"grammar_compiles": self.compiles, "grammar_cache_hits": self.cache_hits,
                "grammar_compile_seconds": self.compile_s}
