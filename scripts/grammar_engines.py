"""Compare the grammar engines kvserve could use for structured outputs (xgrammar, llguidance)
on this machine, with the default model's tokenizer: tokenizer set-up, schema compile time,
and the per-step mask time of a batch of constrained streams.

    pip install xgrammar llguidance   # only the chosen one is a kvserve dependency
    .venv/bin/python scripts/grammar_engines.py [--batch 32] [--threads 2]

Each stream of the batch walks a valid instance of the nested schema token by token (the
streams start at different offsets, so the batch holds many parser states); a step is one
batched fill of every stream's mask plus its application to [batch, vocab] float32 logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvserve.models import default_model
from kvserve.workers.loading.tokenizer import load_tokenizer
from kvserve.workers.structured.vocab import build_vocab

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"enum": ["France", "Spain", "Italy", "Japan"]},
            "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
            "landmarks": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 30},
                               "year": {"anyOf": [{"type": "integer", "minimum": 0,
                                                   "maximum": 2100}, {"type": "null"}]}},
                "required": ["name", "year"], "additionalProperties": False}},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "country", "population", "landmarks", "capital"],
        "additionalProperties": False,
    },
    "wide": {
        "type": "object",
        "$defs": {"addr": {"type": "object", "properties": {
            "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"]}},
        "properties": {**{f"field_{i}": {"type": ["string", "number", "boolean"]}
                          for i in range(24)},
                       "home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}},
        "required": ["field_0", "home"],
    },
}
INSTANCE = {"city": "Paris", "country": "France", "population": 2100000,
            "landmarks": [{"name": "Eiffel Tower", "year": 1889},
                          {"name": "Louvre Museum", "year": None}], "capital": True}


def _time(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Xgr:
    name = "xgrammar"

    def __init__(self, vocab, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo(vocab.tokens, xgr.VocabType.RAW, vocab_size=len(vocab.tokens),
                                      stop_token_ids=vocab.eos_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(threads)
        self.V = len(vocab.tokens)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def accept(self, m, tok: int) -> bool:
        return m.accept_token(tok)

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.V)

    def fill(self, ms, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, backend="cpu")


class Llg:
    name = "llguidance"

    def __init__(self, vocab, threads: int) -> None:
        import llguidance as llg
        import llguidance.torch as lt

        class _Tok:
            eos_token_id = vocab.eos_ids[0]
            bos_token_id = None
            tokens = vocab.tokens
            special_token_ids = vocab.special_ids

            def __call__(self, s):  # only used for ff-tokens; greedy is fine here
                return []

        self.llg, self.lt = llg, lt
        self.tok = llg.LLTokenizer(llg.TokenizerWrapper(_Tok()), n_vocab=len(vocab.tokens),
                                   eos_token=vocab.eos_ids)
        self.executor = llg.LLExecutor(threads)
        self.V = len(vocab.tokens)

    def compile(self, schema: dict):
        g = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ",
                                          "key_separator": ": "})
        m = self.llg.LLMatcher(self.tok, g)  # grammar construction is the compile step
        assert not m.is_error(), m.get_error()
        return g

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled)

    def accept(self, m, tok: int) -> bool:
        return m.consume_token(tok)

    def bitmask(self, n: int) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(n, self.V)

    def fill(self, ms, bitmask) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)],
                                            bitmask)

    def apply(self, logits, bitmask) -> None:
        apply_torch(logits, bitmask)


def apply_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, -float("inf"))


def run(engine_cls, vocab, tokenizer, batch: int, threads: int) -> dict:
    t0 = time.perf_counter()
    eng = engine_cls(vocab, threads)
    setup = time.perf_counter() - t0
    compile_ms = {k: 1e3 * _time(lambda s=s: eng.compile(s), 3) for k, s in SCHEMAS.items()}
    first_ms = {}
    compiled = eng.compile(SCHEMAS["nested"])
    # the instance as the grammar writes it: compact JSON with ", " and ": "
    ids = tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False) + vocab.eos_ids[:1]
    ms = []
    for b in range(batch):
        m = eng.matcher(compiled)
        for t in ids[: (b * 3) % (len(ids) // 2)]:
            assert eng.accept(m, t), (eng.name, b, t)
        ms.append(m)
    mask = eng.bitmask(batch)
    logits = torch.randn(batch, eng.V)
    t0 = time.perf_counter()
    eng.fill(ms[:1], mask[:1])
    first_ms["first_mask"] = 1e3 * (time.perf_counter() - t0)
    fills, applies, applies_torch = [], [], []
    offs = [(b * 3) % (len(ids) // 2) for b in range(batch)]
    for step in range(len(ids) // 2):
        t0 = time.perf_counter()
        eng.fill(ms, mask)
        t1 = time.perf_counter()
        eng.apply(logits, mask)
        t2 = time.perf_counter()
        apply_torch(logits, mask)
        fills.append(t1 - t0)
        applies.append(t2 - t1)
        applies_torch.append(time.perf_counter() - t2)
        for m, o in zip(ms, offs, strict=True):
            assert eng.accept(m, ids[o + step]), (eng.name, o + step)
    return {"setup_s": setup, "compile_ms": compile_ms, **first_ms,
            "fill_ms": 1e3 * statistics.median(fills), "apply_ms": 1e3 * statistics.median(applies),
            "apply_torch_ms": 1e3 * statistics.median(applies_torch),
            "steps": len(fills)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(default_model())
    t0 = time.perf_counter()
    vocab = build_vocab(tok, tok.vocab_size)
    print(f"vocabulary: {len(vocab.tokens)} tokens, bytes built in "
          f"{time.perf_counter() - t0:.2f} s; eos {vocab.eos_ids}")
    for cls in (Xgr, Llg):
        r = run(cls, vocab, tok, a.batch, a.threads)
        comp = ", ".join(f"{k} {v:.1f} ms" for k, v in r["compile_ms"].items())
        print(f"{cls.name}: tokenizer set-up {r['setup_s']:.2f} s; compile {comp}; "
              f"first mask {r['first_mask']:.2f} ms; B={a.batch} step: fill {r['fill_ms']:.2f} ms "
              f"+ apply {r['apply_ms']:.2f} ms (torch unpack: {r['apply_torch_ms']:.2f} ms; median of "
              f"{r['steps']} steps)")


if __name__ == "__main__":
    main()
