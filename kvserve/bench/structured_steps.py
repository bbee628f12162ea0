"""`kvserve bench throughput --json-schema-share F`: what structured outputs cost a batch.

One engine runs the throughput workload in alternating passes (`--rounds` of each):
unconstrained (greedy, EOS ignored, every
request exactly its output length), then with a share F of the requests constrained to a
JSON schema whose answer cannot end within that length (a long array of records), so both
passes have the same batch shapes and token counts. Reported: each pass's tokens/s, its
median decode step time at the full batch, their ratio (the median over rounds), and the schema's compile time
(cold, then from the cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

# The constrained requests' schema: records with enums, bounded integers, numbers, short
# strings and booleans; minItems keeps the answer open for any output length the bench uses.
RECORDS = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 100000, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                       "kind": {"enum": ["order", "refund", "transfer"]},
                       "amount": {"type": "number"},
                       "note": {"type": "string", "maxLength": 24},
                       "ok": {"type": "boolean"}},
        "required": ["id", "kind", "amount", "note", "ok"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}


def _pass(engine: Any, prompts: list[list[int]], params: list[Any], full: int) -> dict[str, Any]:
    """Run the requests; time every step, keep decode-only steps at the full batch."""
    engine.kv.reset_prefix_cache()
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(p, sp)
    steps: list[float] = []
    tokens = 0
    t_start = time.perf_counter()
    while engine.has_unfinished():
        running = len(engine.scheduler.running)
        before = engine.prompt_tokens_computed
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        tokens += sum(len(o.delta_token_ids) for o in outs)
        # a decode-only step computes one token per running stream
        if running == full and engine.prompt_tokens_computed - before == full:
            steps.append(dt)
    elapsed = time.perf_counter() - t_start
    return {"elapsed_s": elapsed, "output_tokens": tokens,
            "output_tokens_per_s": tokens / elapsed, "full_batch_steps": len(steps),
            "step_ms_median": 1e3 * statistics.median(steps) if steps else float("nan")}


def run(args: argparse.Namespace, threads: int, inp: tuple[int, int],
        out: tuple[int, int]) -> dict[str, Any]:
    from kvserve.bench.throughput import make_workload
    from kvserve.config import EngineConfig
    from kvserve.sampling import SamplingParams
    from kvserve.structured import json_schema_output
    from kvserve.workers.engine.engine import LLMEngine
    from kvserve.workers.structured import grammars

    schema = RECORDS
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            schema = json.load(f)
    spec = json_schema_output(schema, strict=True)
    kv_tokens = args.kv_cache_tokens or max(32768, args.num_seqs * (inp[1] + out[1] + 16))
    engine = LLMEngine(EngineConfig(
        model=args.model, num_threads=threads, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=kv_tokens,
        enforce_eager=args.enforce_eager,
    ))
    vocab = engine.model_config.vocab_size
    prompts, out_lens = make_workload(args.num_seqs, inp, out, vocab, args.seed)
    n_constrained = round(args.json_schema_share * len(prompts))
    full = min(args.max_num_seqs, len(prompts))

    grammars.clear_cache()
    t0 = time.perf_counter()
    engine.grammars.compile(spec)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.grammars.compile(spec)
    cached_s = time.perf_counter() - t0

    def free(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)

    # warm-up (the first steps of a fresh engine, the first masks of a fresh matcher)
    warm, _ = make_workload(4, (16, 16), (4, 4), vocab, args.seed + 1)
    _pass(engine, warm, [free(4), free(4), SamplingParams(max_tokens=4, structured=spec),
                         SamplingParams(max_tokens=4, structured=spec)], 4)

    # every k-th request constrained, spread over the batch
    step = max(1, len(prompts) // max(1, n_constrained))
    chosen = set(range(0, len(prompts), step)[:n_constrained])
    mixed_params = [SamplingParams(max_tokens=n, temperature=0.0, structured=spec) if i in chosen
                    else free(n) for i, n in enumerate(out_lens)]
    # the two passes alternate, so drift and other load fall on both
    rounds = []
    for _ in range(args.rounds):
        base = _pass(engine, prompts, [free(n) for n in out_lens], full)
        mixed = _pass(engine, prompts, mixed_params, full)
        print(f"round {len(rounds) + 1}: median step {base['step_ms_median']:.1f} ms "
              f"unconstrained, {mixed['step_ms_median']:.1f} ms with json_schema",
              file=sys.stderr, flush=True)
        rounds.append({"unconstrained": base, "with_json_schema": mixed,
                       "step_ratio": mixed["step_ms_median"] / base["step_ms_median"]})
    return {
        "schema_chars": len(spec.spec), "compile_s": compile_s, "compile_cached_s": cached_s,
        "constrained": len(chosen), "requests": len(prompts), "batch": full, "rounds": rounds,
        "step_ratio": statistics.median(r["step_ratio"] for r in rounds),
    }


def print_report(r: dict[str, Any]) -> None:
    print(f"json_schema share: {r['constrained']} of {r['requests']} requests constrained "
          f"(schema of {r['schema_chars']} characters; compile {1e3 * r['compile_s']:.0f} ms "
          f"cold, {1e6 * r['compile_cached_s']:.0f} us cached)")
    print(f"{'pass':<18}{'out tok/s':>11}{'elapsed s':>11}{'steps at B=' + str(r['batch']):>16}"
          f"{'median step ms':>16}")
    for i, rnd in enumerate(r["rounds"]):
        for name in ("unconstrained", "with_json_schema"):
            p = rnd[name]
            print(f"{name + ' ' + str(i + 1):<18}{p['output_tokens_per_s']:>11.1f}"
                  f"{p['elapsed_s']:>11.2f}{p['full_batch_steps']:>16}{p['step_ms_median']:>16.1f}")
    ratios = ", ".join(f"{x['step_ratio']:.3f}" for x in r["rounds"])
    print(f"step time with json_schema / unconstrained at B={r['batch']}: {r['step_ratio']:.3f}x "
          f"(median of rounds: {ratios})")
