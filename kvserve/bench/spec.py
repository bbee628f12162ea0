"""`kvserve bench spec`: the same requests with speculative decoding off and on.

Two workloads of chat requests through the model's chat template: `copy` asks for text the
prompt already holds (code edits, repeated lists: what n-gram proposals are made for) and
`chat` asks ordinary questions. For each batch size B, the workload's prompts (each with
its own numbers so no two are equal, cycled up to B, every prompt at least once: a batch of
one is the whole workload one request at a time, not its first prompt) are generated with
`LLM.chat` in calls of B requests, by an engine without speculation and by one with it (same
model, same settings otherwise, both built once and warmed up), `--rounds` times each,
alternating which engine goes first; greedy, so both must give the same tokens (the
`identical` column checks it). Figures: the median output tokens per second of the point's
calls (prompts included), the ratio of the medians, and the speculating engine's acceptance
over the runs (vLLM's acceptance rate and mean acceptance length) and its steps that
verified proposals (per run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from kvserve.bench.common import Timer, identical, machine_info, write_json

COPY_PROMPTS = [
    "Rename the variable `total` to `acc` in this function and output the whole function:\n"
    "```python\ndef sum_prices(items, tax={n}):\n    total = 0\n    for item in items:\n"
    "        total += item.price * (1 + tax / 100)\n    if total > {m}:\n"
    "        total -= {n}\n    return total\n```",
    "Repeat this shopping list exactly, then add \"{m} eggs\" at the end:\n- {n} apples\n"
    "- 2 loaves of bread\n- 1 litre of milk\n- 3 onions\n- {n} carrots\n- 1 bag of rice\n",
    "Add a docstring to this function and output the whole function:\n```python\n"
    "def clamp(value, low={n}, high={m}):\n    if value < low:\n        return low\n"
    "    if value > high:\n        return high\n    return value\n```",
    "Copy this table and change the price of pears to {m}:\n| fruit | price |\n|---|---|\n"
    "| apples | {n} |\n| pears | 7 |\n| plums | 4 |\n| grapes | 12 |\n",
    "Fix the typo in this JSON and output it again:\n{{\"name\": \"server-{n}\", \"port\": {m}, "
    "\"hosts\": [\"alpha\", \"beta\", \"gamma\"], \"retires\": 3, \"timeout_s\": 30}}",
    "Convert this list to a numbered list:\n- check the logs of node {n}\n- restart the worker\n"
    "- drain the queue\n- rotate the keys\n- page the on-call engineer after {m} minutes\n",
]

CHAT_PROMPTS = [
    "What are {n} good reasons to take up cycling?",
    "Explain in {n} sentences how a refrigerator keeps food cold.",
    "Write a short poem about a lighthouse at night, number {n}.",
    "Give me {n} tips for learning a new language.",
    "Why is the sky blue? Answer for a {n}-year-old.",
    "Suggest a name for a cafe on street number {m} and say why.",
]

WORKLOADS = {"copy": COPY_PROMPTS, "chat": CHAT_PROMPTS}


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("spec", help="speculative decoding off and on: tokens/s and acceptance")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    p.add_argument("--workloads", default="copy,chat", help="comma list of: copy, chat")
    p.add_argument("--batch", default="1,8,32", help="requests per generate call (comma list)")
    p.add_argument("--max-tokens", type=int, default=128, help="generated tokens per request at most")
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                   metavar="JSON", help="the speculating engine's --speculative-config")
    p.add_argument("--always", action="store_true",
                   help="verify every proposal whatever the cost model says (the verify path's "
                        "raw figures, not what serving gets)")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each point per engine, alternating which goes first; the "
                        "medians are shown")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpu-matmul", choices=["int8", "exact"], default="int8",
                   help="CPU on GGUF blocks: 8-bit activations (int8, the engine's default: "
                        "verifying k+1 rows reads each weight block once) or float32 ones (exact)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=cmd_spec)


def prompts(workload: str, n: int) -> list[list[dict[str, str]]]:
    """`n` one-turn conversations of the workload, each with its own numbers."""
    base = WORKLOADS[workload]
    return [[{"role": "user", "content": base[i % len(base)].format(n=3 + i, m=40 + 7 * i)}]
            for i in range(n)]


def calls(workload: str, batch: int) -> list[list[list[dict[str, str]]]]:
    """The point's `chat` calls: every prompt of the workload at least once (a batch of one
    is not one prompt's figure), `batch` conversations per call."""
    convs = prompts(workload, max(batch, len(WORKLOADS[workload])))
    return [convs[i : i + batch] for i in range(0, len(convs), batch)]


def run(llm: Any, batches: list[list[list[dict[str, str]]]],
        max_tokens: int) -> tuple[Timer, list[list[int]]]:
    """One `chat` call per batch, timed together."""
    from kvserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs: list[list[int]] = []
    with Timer() as t:
        for convs in batches:
            outs += [list(o.token_ids) for o in llm.chat(convs, sp)]
    return t, outs


def spec_counts(llm: Any) -> dict[str, float]:
    st = llm.engine.stats()
    return {k: st[k] for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens",
                               "spec_steps", "spec_steps_off_batch", "spec_steps_off_cost")}


def cmd_spec(a: argparse.Namespace) -> int:
    import torch

    from kvserve import LLM
    from kvserve.hardware import available_cores
    from kvserve.speculative import parse_speculative_config

    threads = a.threads or available_cores()
    spec = parse_speculative_config(a.speculative_config)
    batches = [int(x) for x in a.batch.split(",") if x.strip()]
    workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            print(f"unknown workload {w!r} (copy, chat)", file=sys.stderr)
            return 2
    kw = {"num_threads": threads, "max_num_seqs": max(a.max_num_seqs, max(batches)),
          "host_cache_gib": 0, "cpu_matmul": a.cpu_matmul}
    off = LLM(a.model, **kw)
    on = LLM(a.model, speculative_config=spec, **kw)
    if a.always:
        on.engine.spec.policy.always = True
    warm = [prompts("copy", 2)]
    for llm in (off, on):
        run(llm, warm, 16)
    rows = []
    print(f"{'workload':8} {'B':>3} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7} "
          f"{'accept':>7} {'mean len':>8} {'spec steps':>10} {'identical':>9}")
    for w in workloads:
        for b in batches:
            batches_b = calls(w, b)
            before = spec_counts(on)
            rates: dict[str, list[float]] = {"off": [], "on": []}
            cpu: dict[str, list[float]] = {"off": [], "on": []}
            outs: dict[str, Any] = {}
            for r in range(a.rounds):  # off/on, then on/off: drift weighs on both alike
                for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    t, outs[name] = run(off if name == "off" else on, batches_b, a.max_tokens)
                    rates[name].append(sum(len(o) for o in outs[name]) / t.elapsed)
                    cpu[name].append(t.cpu / t.elapsed)
            after = spec_counts(on)
            d = {k: (after[k] - before[k]) / a.rounds for k in after}
            n_on = sum(len(o) for o in outs["on"])
            same = identical(outs["off"], outs["on"])
            row = {
                "workload": w, "batch": b, "output_tokens": n_on, "rounds": a.rounds,
                "off_tok_s": statistics.median(rates["off"]),
                "on_tok_s": statistics.median(rates["on"]),
                "round_ratios": [y / x for x, y in zip(rates["off"], rates["on"], strict=True)],
                "off_cpu_per_wall": statistics.median(cpu["off"]),
                "on_cpu_per_wall": statistics.median(cpu["on"]),
                "acceptance_rate": d["spec_accepted_tokens"] / d["spec_draft_tokens"]
                if d["spec_draft_tokens"] else 0.0,
                "mean_accepted_length": 1 + d["spec_accepted_tokens"] / d["spec_drafts"]
                if d["spec_drafts"] else 0.0,
                "spec_steps": d["spec_steps"],
                "steps_off_batch": d["spec_steps_off_batch"],
                "steps_off_cost": d["spec_steps_off_cost"],
                "identical": same["identical"], "of": same["of"],
            }
            row["ratio"] = row["on_tok_s"] / row["off_tok_s"]
            rows.append(row)
            print(f"{w:8} {b:>3} {row['off_tok_s']:>10.1f} {row['on_tok_s']:>9.1f} "
                  f"{row['ratio']:>6.2f}x {row['acceptance_rate']:>7.2f} "
                  f"{row['mean_accepted_length']:>8.2f} {d['spec_steps']:>10.0f} "
                  f"{same['identical']:>5}/{same['of']}", flush=True)
    report = {"bench": "spec", "speculative_config": json.loads(spec.model_dump_json()),
              "always": a.always, "max_tokens": a.max_tokens,
              "machine": machine_info(torch.get_num_threads()), "rows": rows}
    write_json(a.json, report)
    return 0
