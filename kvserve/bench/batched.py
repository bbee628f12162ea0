"""`kvserve bench batched`: the grid and columns of llama.cpp's llama-batched-bench.

For every (PP, TG, B): B streams each get their own random PP-token prompt, all
prompts are processed together (chunked by the step budget), then TG decode
steps run for all B streams at once. Columns, as llama-batched-bench prints them:
N_KV = B*(PP+TG), T_PP/S_PP = prompt time and tokens/s, T_TG/S_TG = generation
time and tokens/s, T/S = total. The model runner is driven directly (greedy
argmax, no detokenization), as llama-batched-bench drives llama_decode.

`--llama-batched-bench BIN` runs llama.cpp's own binary on the same GGUF point by point,
interleaved with kvserve's (kvserve, llama.cpp, next point), and prints both and their
ratios: the two see the same machine state, which on a shared host drifts within minutes.
`--repeat N` runs every point N times, alternating the two engines each time, and prints
the medians, with the range of the paired ratios (each kvserve run against the llama.cpp
run right after it): one run of a point on a noisy host can be off by 20% either way.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
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
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="the KV cache's dtype (auto: the model's; llama.cpp's default is float16)")
    p.add_argument("--cpu-matmul", choices=["int8", "exact"], default="int8",
                   help="CPU quantized-block matmuls: 8-bit activations (int8, the engine's "
                   "default) or float32 ones (exact)")
    p.add_argument("--llama-batched-bench", default=None, metavar="BIN",
                   help="also run llama.cpp's llama-batched-bench (this path) on the same GGUF, "
                   "point by point, interleaved")
    p.add_argument("--llama-args", default="-fa on",
                   help="extra llama-batched-bench arguments (with --llama-batched-bench)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="runs per point (alternating with llama.cpp's); the tables give medians")
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

    if a.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    npp, ntg, npl = _ints(a.npp), _ints(a.ntg), _ints(a.npl)
    need = max(npl) * (max(npp) + max(ntg) + 1)
    cfg = EngineConfig(model=a.model, kv_cache_tokens=need + 64 * a.block_size, max_num_seqs=max(npl),
                       block_size=a.block_size, enable_prefix_caching=False,
                       max_num_batched_tokens=a.max_num_batched_tokens,
                       quantized_decode=a.quantized_decode, cpu_matmul=a.cpu_matmul,
                       kv_cache_dtype=a.kv_cache_dtype,
                       attention_backend=a.attention_backend, enforce_eager=a.enforce_eager,
                       host_cache_gib=0)
    path = resolve_model(a.model)
    loaded = load_model(path, DTYPES[cfg.resolved_dtype()])
    runner = ModelRunner(loaded, cfg)
    run_point(runner, 16, 4, 2, a.max_num_batched_tokens, seed=99)  # warm-up
    rows, peer = [], []
    points = [(pp, tg, b) for pp in npp for tg in ntg for b in npl]
    bar = None
    if a.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(points), desc="batched", unit="pt", file=sys.stderr)
    for i, (pp, tg, b) in enumerate(points):
        mine, theirs = [], []
        for _ in range(a.repeat):  # the same prompts each time
            load = os.getloadavg()[0]
            mine.append(run_point(runner, pp, tg, b, a.max_num_batched_tokens, seed=i))
            mine[-1]["load_1min"] = load
            if a.llama_batched_bench:
                theirs.append(run_llama_point(a, path, pp, tg, b))
        rows.append(median_row(mine))
        if theirs:
            peer.append(median_row(theirs))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if runner.device.type == "cuda":
        add_roofline(runner, rows)
    print(format_table(rows))
    if peer:
        print()
        print(format_comparison(rows, peer))
    print(f"1-minute load before each point: {min(r['load_1min'] for r in rows):.2f}-"
          f"{max(r['load_1min'] for r in rows):.2f}; runtime: {runner.runtime}")
    if a.json:
        report: dict[str, Any] = {"machine": machine_info(torch.get_num_threads()),
                                  "runtime": runner.runtime, "results": rows}
        if peer:
            report["llama_cpp"] = peer
        write_json(a.json, report)
    return 0


def median_row(runs: list[dict[str, float]]) -> dict[str, Any]:
    """One point's runs as one row: each figure's median (PP, TG, B and N_KV are the same in
    every run), with every run's S_PP and S_TG kept in `runs_S_PP` / `runs_S_TG`."""
    row: dict[str, Any] = {k: (statistics.median(r[k] for r in runs) if k not in ("PP", "TG", "B", "N_KV")
                               else runs[0][k]) for k in runs[0]}
    row["runs_S_PP"] = [r["S_PP"] for r in runs]
    row["runs_S_TG"] = [r["S_TG"] for r in runs]
    return row


def run_llama_point(a: argparse.Namespace, path: str, pp: int, tg: int, b: int) -> dict[str, float]:
    """One point of llama-batched-bench (llama.cpp's own binary) on the GGUF at `path`,
    with kvserve's threads and step budget: its row of figures."""
    import torch

    threads = a.threads or torch.get_num_threads()
    # a context with room for every stream (llama.cpp splits it evenly over the B streams)
    ctx = max(512, b * (pp + tg + 32))
    cmd = [a.llama_batched_bench, "-m", path, "-c", str(ctx),
           "-b", str(a.max_num_batched_tokens), "-ub", "512", "-npp", str(pp), "-ntg", str(tg),
           "-npl", str(b), "-t", str(threads), *shlex.split(a.llama_args)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = parse_llama_table(out)
    if len(rows) != 1:
        raise RuntimeError(f"llama-batched-bench printed {len(rows)} rows for one point: {out[-2000:]}")
    return rows[0]


def parse_llama_table(text: str) -> list[dict[str, float]]:
    """The rows of llama-batched-bench's markdown table (its `-nan` S_PP at PP=0 reads as 0)."""
    keys = ["PP", "TG", "B", "N_KV", "T_PP", "S_PP", "T_TG", "S_TG", "T", "S"]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(keys) or not cells[0].isdigit():
            continue
        vals = [float(c) if c not in ("-nan", "nan", "inf") else 0.0 for c in cells]
        rows.append(dict(zip(keys, vals, strict=True)))
    return rows


def _ratio_range(mine: list[float], theirs: list[float]) -> str:
    """The lowest and highest of the paired runs' ratios (run i against run i)."""
    rs = [m / t for m, t in zip(mine, theirs, strict=True) if t]
    return f"{min(rs):.2f}-{max(rs):.2f}" if rs else "-"


def format_comparison(rows: list[dict[str, Any]], peer: list[dict[str, Any]]) -> str:
    """kvserve's S_PP and S_TG next to llama.cpp's, point by point, and their ratios (of the
    medians; with several runs a point, also the range of the paired runs' ratios)."""
    runs = len(rows[0].get("runs_S_TG", [0])) if rows else 1
    rng = " paired runs |" if runs > 1 else ""
    head = (f"|    PP |    B | llama.cpp S_PP | kvserve S_PP | ratio |{rng} llama.cpp S_TG | "
            f"kvserve S_TG | ratio |{rng}")
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for r, q in zip(rows, peer, strict=True):
        pp_ratio = f"{r['S_PP'] / q['S_PP']:5.2f}" if r["PP"] and q["S_PP"] else "    -"
        pp_l = f"{q['S_PP']:14.1f}" if r["PP"] else f"{'-':>14}"
        pp_k = f"{r['S_PP']:12.1f}" if r["PP"] else f"{'-':>12}"
        pp_rng = tg_rng = ""
        if runs > 1:
            pp_rng = f" {_ratio_range(r['runs_S_PP'], q['runs_S_PP']) if r['PP'] else '-':>11} |"
            tg_rng = f" {_ratio_range(r['runs_S_TG'], q['runs_S_TG']):>11} |"
        lines.append(f"| {int(r['PP']):5d} | {int(r['B']):4d} | {pp_l} | {pp_k} | {pp_ratio} |{pp_rng} "
                     f"{q['S_TG']:14.1f} | {r['S_TG']:12.1f} | {r['S_TG'] / q['S_TG']:5.2f} |{tg_rng}")
    if runs > 1:
        lines.append(f"medians of {runs} runs a point, the engines alternating")
    return "\n".join(lines)


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
