"""`kvserve bench batched`: the grid and columns of llama.cpp's llama-batched-bench.

For every (PP, TG, B): B streams each get their own random PP-token prompt, all
prompts are processed together (chunked by the step budget), then TG decode
steps run for all B streams at once. Columns, as llama-batched-bench prints them:
N_KV = B*(PP+TG), T_PP/S_PP = prompt time and tokens/s, T_TG/S_TG = generation
time and tokens/s, T/S = total. The model runner is driven directly (greedy
argmax, no detokenization), as llama-batched-bench drives llama_decode.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvserve.bench.common import write_json


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("batched", help="llama-batched-bench style PP/TG grid")
    p.add_argument("--npp", default="0,128,512,1024", help="prompt lengths (comma list)")
    p.add_argument("--ntg", default="32", help="generated tokens (comma list)")
    p.add_argument("--npl", default="1,8,32", help="parallel streams B (comma list)")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="prompt tokens per step (llama.cpp's -b)")
    p.add_argument("--quantized-decode", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash"])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=cmd_batched)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def run_point(runner: Any, pp: int, tg: int, b: int, budget: int, seed: int) -> dict[str, float]:
    import torch

    from kvserve.kvcache.manager import StreamStep

    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    # PP=0 has no prompt: each stream starts from one token, counted as generated
    toks = {f"s{i}": torch.randint(100, vocab - 100, (max(pp, 1),), generator=g).tolist()
            for i in range(b)}
    t0 = time.perf_counter()
    if pp > 0:
        pending = list(toks)
        while pending:
            steps, left = [], budget
            for sid in pending:
                done = runner.kv.num_computed(sid)
                n = min(pp - done, left)
                if n <= 0:
                    break
                steps.append(StreamStep(sid, toks[sid], done + n))
                left -= n
            runner.execute(steps)
            pending = [s for s in pending if runner.kv.num_computed(s) < pp]
        for t in toks.values():
            t.append(t[-1])  # the first generated token's value does not change the cost
    t_pp = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(tg):  # with PP=0 the first step decodes each stream's starting token
        steps = [StreamStep(sid, t, len(t)) for sid, t in toks.items()]
        _, logits = runner.execute(steps)
        for t, nxt in zip(toks.values(), logits.argmax(-1).tolist(), strict=True):
            t.append(nxt)
    t_tg = time.perf_counter() - t1
    for sid in toks:
        runner.free(sid)
    n_kv = b * (pp + tg)
    return {
        "PP": pp, "TG": tg, "B": b, "N_KV": n_kv,
        "T_PP": t_pp, "S_PP": b * pp / t_pp if pp else 0.0,
        "T_TG": t_tg, "S_TG": b * tg / t_tg,
        "T": t_pp + t_tg, "S": n_kv / (t_pp + t_tg),
    }


def cmd_batched(a: argparse.Namespace) -> int:
    import torch

    from kvserve.bench.common import machine_info
    from kvserve.config import EngineConfig
    from kvserve.models import resolve_model
    from kvserve.workers.loading.loader import load_model
    from kvserve.workers.model.runner import DTYPES, ModelRunner

    if a.threads:
        torch.set_num_threads(a.threads)
    npp, ntg, npl = _ints(a.npp), _ints(a.ntg), _ints(a.npl)
    need = max(npl) * (max(npp) + max(ntg) + 1)
    cfg = EngineConfig(model=a.model, kv_cache_tokens=need + 64 * a.block_size, max_num_seqs=max(npl),
                       block_size=a.block_size, enable_prefix_caching=False,
                       max_num_batched_tokens=a.max_num_batched_tokens,
                       quantized_decode=a.quantized_decode, attention_backend=a.attention_backend,
                       enforce_eager=a.enforce_eager)
    loaded = load_model(resolve_model(a.model), DTYPES[cfg.resolved_dtype()])
    runner = ModelRunner(loaded, cfg)
    run_point(runner, 16, 4, 2, a.max_num_batched_tokens, seed=99)  # warm-up
    rows = []
    points = [(pp, tg, b) for pp in npp for tg in ntg for b in npl]
    bar = None
    if a.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(points), desc="batched", unit="pt", file=sys.stderr)
    for i, (pp, tg, b) in enumerate(points):
        rows.append(run_point(runner, pp, tg, b, a.max_num_batched_tokens, seed=i))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if runner.device.type == "cuda":
        add_roofline(runner, rows)
    print(format_table(rows))
    if a.json:
        write_json(a.json, {"machine": machine_info(torch.get_num_threads()), "results": rows})
    return 0


def add_roofline(runner: Any, rows: list[dict[str, float]]) -> None:
    """Each row's decode roofline (tokens/s) at its mean context, and S_TG's fraction of it."""
    from kvserve.bench.roofline import copy_bandwidth_gbps, roofline_for

    gbps = copy_bandwidth_gbps(runner.device)
    for r in rows:
        r["copy_GBps"] = gbps
        r["ROOF_TG"] = roofline_for(runner, gbps, int(r["B"]), r["PP"] + r["TG"] / 2)
        r["FRAC_TG"] = r["S_TG"] / r["ROOF_TG"]


def format_table(rows: list[dict[str, float]]) -> str:
    head = "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
    roof = bool(rows) and "ROOF_TG" in rows[0]
    if roof:  # CUDA: S_TG against the decode roofline (bench/roofline.py)
        head += " ROOF t/s | of roof |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        line = (
            f"| {r['PP']:5d} | {r['TG']:6d} | {r['B']:4d} | {r['N_KV']:6d} | {r['T_PP']:8.3f} | "
            f"{r['S_PP']:8.2f} | {r['T_TG']:8.3f} | {r['S_TG']:8.2f} | {r['T']:8.3f} | {r['S']:8.2f} |"
        )
        if roof:
            line += f" {r['ROOF_TG']:8.0f} | {r['FRAC_TG']:7.1%} |"
        lines.append(line)
    if roof:
        lines.append(f"roofline: weights + attended KV per decode step over {rows[0]['copy_GBps']:.0f} "
                     "GB/s measured device-to-device copy bandwidth")
    return "\n".join(lines)
