"""`kvserve bench multiturn`: time to first token of follow-up turns, host tier vs without.

--conversations conversations take turns round-robin. Every turn sends the whole
history (previous prompts and answers) plus --turn-len new random tokens and generates
--output-len tokens (greedy, EOS ignored); turns run one at a time, so TTFT is the
prefill of the part of the history no cache holds. The device pool holds about one
conversation's final history, so by the time a conversation's next turn comes, the
others have pushed its blocks off the device: without a host tier the history is
recomputed, with it the history comes back by copy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from kvserve.bench.common import add_restore_policy_arg, write_json


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("multiturn", help="follow-up-turn TTFT with and without the host KV tier")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--turn-len", type=int, default=256, help="new user tokens per turn")
    p.add_argument("--output-len", type=int, default=16, help="generated tokens per turn")
    p.add_argument("--device-tokens", type=int, default=None,
                   help="device pool (default: one conversation's final history plus a turn)")
    p.add_argument("--host-gib", type=float, default=None, help="host tier size (default: auto)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--min-history", type=int, default=1000,
                   help="also report TTFT over follow-ups whose history is at least this long")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    add_restore_policy_arg(p)
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=cmd_multiturn)


def run(args: argparse.Namespace, host_gib: float | None, device_tokens: int) -> dict[str, Any]:
    from kvserve.bench.common import random_prompts
    from kvserve.llm import LLM
    from kvserve.sampling import SamplingParams

    llm = LLM(model=args.model, kv_cache_tokens=device_tokens, block_size=args.block_size,
              host_cache_gib=host_gib, num_threads=args.threads,
              host_restore_policy=args.restore_policy)
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    n = args.output_len
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(1, 32, vocab, args.seed + 999)[0], params)  # warm-up
    history = [[] for _ in range(args.conversations)]  # type: list[list[int]]
    turns: list[dict[str, Any]] = []
    for t in range(args.turns):
        for c in range(args.conversations):
            new = random_prompts(1, args.turn_len, vocab, args.seed + 1 + t * args.conversations + c)[0]
            prompt = history[c] + new
            before = eng.stats()
            t0 = time.perf_counter()
            rid = eng.add_request(prompt, params)
            ttft = None
            out: list[int] = []
            while eng.has_unfinished():
                for o in eng.step():
                    if o.request_id == rid:
                        if ttft is None and o.delta_token_ids:
                            ttft = time.perf_counter() - t0
                        out = o.token_ids
            after = eng.stats()
            turns.append({
                "conversation": c, "turn": t, "history": len(history[c]), "prompt": len(prompt),
                "ttft_s": ttft, "total_s": time.perf_counter() - t0,
                "host_hit_tokens": after["host_prefix_hit_tokens"] - before["host_prefix_hit_tokens"],
                "output": out,
            })
            history[c] = prompt + out
    follow = [x for x in turns if x["turn"] > 0]
    long = [x for x in follow if x["history"] >= args.min_history]
    s = eng.stats()
    return {
        "device_kv_tokens": eng.kv.num_blocks * eng.kv.block_size,
        "host_blocks": s["host_blocks_total"],
        "turns": [{k: v for k, v in x.items() if k != "output"} for x in turns],
        "outputs": [x["output"] for x in turns],
        "first_turn_ttft_s": statistics.median(x["ttft_s"] for x in turns if x["turn"] == 0),
        "follow_up_ttft_s": statistics.median(x["ttft_s"] for x in follow) if follow else None,
        "long_follow_up_ttft_s": statistics.median(x["ttft_s"] for x in long) if long else None,
        "long_follow_ups": len(long),
        "host_prefix_hit_tokens": s["host_prefix_hit_tokens"],
        "copy_gbps": s["copy_gbps"],
    }


def cmd_multiturn(args: argparse.Namespace) -> int:
    import torch

    from kvserve.bench.common import available_cores, machine_info

    if min(args.conversations, args.turns, args.turn_len, args.output_len) < 1 or args.turns < 2:
        print("kvserve bench multiturn: sizes must be >= 1 and --turns >= 2", file=sys.stderr)
        return 2
    threads = args.threads or available_cores()
    torch.set_num_threads(threads)
    args.threads = threads
    final = args.turns * (args.turn_len + args.output_len)
    device = args.device_tokens or final + args.turn_len + args.block_size
    report: dict[str, Any] = {
        "benchmark": "multiturn",
        "workload": {"conversations": args.conversations, "turns": args.turns, "turn_len": args.turn_len,
                     "output_len": args.output_len, "final_history": final,
                     "all_histories": args.conversations * final, "device_kv_tokens": device,
                     "min_history": args.min_history, "model": args.model or "default"},
        "machine": machine_info(threads),
    }
    without = run(args, 0.0, device)
    with_host = run(args, args.host_gib, device)
    same = without.pop("outputs") == with_host.pop("outputs")
    report["without_host"] = without
    report["with_host"] = with_host
    report["same_outputs"] = same
    for key in ("follow_up_ttft_s", "long_follow_up_ttft_s"):
        if without[key] and with_host[key]:
            report[f"{key}_speedup"] = without[key] / with_host[key]
    print_report(report)
    write_json(args.json, report)
    return 0


def print_report(r: dict[str, Any]) -> None:
    w = r["workload"]
    m = r["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, {m['torch_threads']} threads")
    print(f"workload: {w['conversations']} conversations x {w['turns']} turns of {w['turn_len']} new tokens "
          f"+ {w['output_len']} generated; final history {w['final_history']} tokens each, "
          f"{w['all_histories']} in all; device pool {w['device_kv_tokens']} tokens")
    print(f"{'turn':>5}" + "".join(f"{'c' + str(c) + ' hist':>10}{'no host':>9}{'host':>8}"
                                   for c in range(w['conversations'])))
    a, b = r["without_host"]["turns"], r["with_host"]["turns"]
    for t in range(w["turns"]):
        row = f"{t:>5}"
        for c in range(w["conversations"]):
            i = t * w["conversations"] + c
            row += f"{a[i]['history']:>10}{a[i]['ttft_s'] * 1e3:>7.0f}ms{b[i]['ttft_s'] * 1e3:>6.0f}ms"
        print(row)
    for key, label in (("follow_up_ttft_s", "all follow-up turns"),
                       ("long_follow_up_ttft_s", f"follow-ups with history >= {w['min_history']}")):
        x, y = r["without_host"][key], r["with_host"][key]
        if x and y:
            print(f"median TTFT, {label}: without host tier {x * 1e3:.0f} ms, with {y * 1e3:.0f} ms "
                  f"({r[key + '_speedup']:.1f}x lower)")
    print(f"host prefix hits: {r['with_host']['host_prefix_hit_tokens']} tokens; "
          f"same outputs with and without: {r['same_outputs']}")
