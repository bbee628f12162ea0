"""`kvserve bench pressure`: throughput when the device KV pool holds only part of the need.

Every request has a random-token prompt and generates exactly --output-len tokens
(greedy, EOS ignored), so the peak KV need is num_prompts * (input_len + output_len)
tokens when all run at once. In one process, on the same prompts:
- unconstrained: a device pool that holds the whole need;
- recompute: a pool of --device-fraction of the need, no host tier (evicted streams are
  recomputed);
- host tier: the same pool plus the host tier (evicted streams come back by copy or are
  recomputed, whichever the restore cost model finds cheaper; --restore-policy forces one);
- hf_continuous (with --baseline hf): transformers' continuous batching with the same KV
  budget (num_blocks * page_size = the constrained pool). On CPU its swap-to-host
  (`cpu_offload_space`) needs pinned memory, so HF re-prefills the requests it evicts.
The three kvserve settings run --rounds times, interleaved (one engine each, caches emptied
between runs), so load on a shared machine falls on all of them alike; each reports its
median round, and the ratios are medians of the rounds' own ratios.
It also times, on the host-tier engine, one stream of input_len + output_len / 2 tokens
written back and restored by copy against the same stream recomputed by prefill.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from kvserve.bench.common import add_async_arg, add_restore_policy_arg, async_value, write_json

COUNTERS = ("evictions", "restores", "tokens_restored_copy", "tokens_restored_device",
            "tokens_recomputed", "host_prefix_hit_tokens", "copy_bytes", "restores_copy",
            "restores_recompute", "writebacks_skipped", "demotions_skipped")
SETTINGS = ("unconstrained", "recompute", "host_tier")


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("pressure", help="throughput with a device KV pool below the need: "
                        "recompute vs host tier vs unconstrained (and transformers)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device-fraction", type=float, default=0.5,
                   help="device pool as a share of the peak KV need (default 0.5)")
    p.add_argument("--host-gib", type=float, default=None, help="host tier size (default: auto)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--lookahead", type=int, default=0,
                   help="admission headroom in tokens per running stream (engine default 128); "
                   "0 admits as much as fits, which eviction to host makes cheap")
    p.add_argument("--policy", choices=["newest", "least_computed", "largest"], default="newest")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of the three kvserve settings (medians reported)")
    p.add_argument("--baseline", choices=["hf", "none"], default="hf")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="float32 on a GPU makes outputs comparable across batch compositions")
    p.add_argument("--seed", type=int, default=0)
    add_async_arg(p)
    add_restore_policy_arg(p)
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=cmd_pressure)


def make_llm(args: argparse.Namespace, prompts: list[list[int]], kv_tokens: int,
             host_gib: float | None) -> Any:
    from kvserve.llm import LLM
    from kvserve.sampling import SamplingParams

    llm = LLM(model=args.model, kv_cache_tokens=kv_tokens, block_size=args.block_size,
              host_cache_gib=host_gib, admission_lookahead_tokens=args.lookahead,
              preemption_policy=args.policy, max_num_seqs=max(64, len(prompts)),
              num_threads=args.threads, dtype=args.dtype,
              async_scheduling=async_value(args.async_scheduling),
              host_restore_policy=args.restore_policy)
    warm = SamplingParams(max_tokens=2, min_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([p[:16] for p in prompts[:2]], warm)
    return llm


def run_once(args: argparse.Namespace, llm: Any, prompts: list[list[int]],
             label: str) -> tuple[dict[str, Any], list[list[int]]]:
    """One timed generate of every prompt on a warm engine whose caches start empty."""
    from kvserve.bench.common import Timer, figures, progress_bar
    from kvserve.bench.serve_load import CpuMeter
    from kvserve.sampling import SamplingParams

    eng = llm.engine
    eng.kv.reset_prefix_cache()  # the last round's prompts: no prefix hits carried over
    n = args.output_len
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    before = eng.stats()
    host = eng.kv.host
    if host is not None:
        c = host.copier
        c0 = (dict(c.blocks), dict(c.seconds))
    with progress_bar(args.progress, len(prompts) * n, label) as bar:
        inner = eng.step

        def step(finished_only: bool = False) -> list[Any]:
            outs = inner()  # every output, for the bar; LLM.generate wants the finished ones
            bar.update(sum(len(o.delta_token_ids) for o in outs))
            return [o for o in outs if o.finished] if finished_only else outs

        eng.step = step  # type: ignore[method-assign]
        with CpuMeter() as meter, Timer() as timer:
            outs = llm.generate(prompts, params)
        del eng.step
    after = eng.stats()
    tokens = [o.token_ids for o in outs]
    res = figures(timer, prompts, tokens)
    res.update({k: after[k] - before[k] for k in COUNTERS})
    res["restore_decisions"] = {k.removeprefix("restores_"): after[k] - before[k] for k in after
                                if k.startswith(("restores_copy_", "restores_recompute_"))
                                and after[k] > before[k]}
    res["other_cores"] = meter.figures.get("other_cores")
    res["kv_cache_tokens"] = eng.kv.num_blocks * eng.kv.block_size
    res["host_blocks"] = after["host_blocks_total"]
    res["failed"] = sum(o.finish_reason != "length" or len(o.token_ids) != n for o in outs)
    if host is not None:
        c = host.copier
        blocks = {d: c.blocks[d] - c0[0][d] for d in ("out", "in")}
        secs = {d: c.seconds[d] - c0[1][d] for d in ("out", "in")}
        res["copy_out_gbps"] = _gbps(blocks["out"] * host.bytes_per_block, secs["out"])
        res["copy_in_gbps"] = _gbps(blocks["in"] * host.bytes_per_block, secs["in"])
        res["copy_out_bytes"] = blocks["out"] * host.bytes_per_block
        res["copy_in_bytes"] = blocks["in"] * host.bytes_per_block
        res["cost_model"] = host.cost.figures()
    return res, tokens


def median_run(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median throughput (its own figures, consistent with each other)."""
    order = sorted(range(len(rounds)), key=lambda i: rounds[i]["output_tokens_per_s"])
    return rounds[order[(len(order) - 1) // 2]]


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def restore_vs_recompute(llm: Any, length: int, seed: int, reps: int = 3) -> dict[str, float]:
    """Seconds per token: one stream's blocks copied out and back in (synchronously, through
    the engine's copy path) vs its prefill."""
    import torch

    from kvserve.bench.common import random_prompts
    from kvserve.kvcache.manager import StreamStep

    eng = llm.engine
    runner, host = eng.runner, eng.kv.host
    assert host is not None
    cuda = runner.device.type == "cuda"
    ids = random_prompts(1, length, eng.model_config.vocab_size, seed + 1000)[0]
    prefill, copy_out, copy_in = [], [], []
    for r in range(reps):
        sid = f"bench-{r}"
        ids_r = [ids[0] + r + 1] + ids[1:]  # a different first token: no prefix-cache hit
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.execute([StreamStep(sid, ids_r, length)])
        if cuda:
            torch.cuda.synchronize()
        prefill.append(time.perf_counter() - t0)
        dev = list(eng.kv.block_table(sid))
        hb = host.table.allocate(len(dev))
        copy_out.append(host.copier.timed_round("out", dev, hb))
        copy_in.append(host.copier.timed_round("in", dev, hb))  # the same content back
        host.table.unallocate(hb)
        eng.kv.free(sid)
    rec = statistics.median(prefill) / length
    res = statistics.median(copy_out) / length + statistics.median(copy_in) / length
    return {"tokens": length, "recompute_s_per_token": rec, "restore_s_per_token": res,
            "copy_out_s_per_token": statistics.median(copy_out) / length,
            "copy_in_s_per_token": statistics.median(copy_in) / length,
            "recompute_over_restore": rec / res if res > 0 else float("inf")}


def cmd_pressure(args: argparse.Namespace) -> int:
    import torch

    from kvserve.bench.common import available_cores, identical, machine_info, random_prompts

    if min(args.num_prompts, args.input_len, args.output_len, args.rounds) < 1 \
            or not 0 < args.device_fraction <= 1:
        print("kvserve bench pressure: sizes and --rounds must be >= 1 and --device-fraction in "
              "(0, 1]", file=sys.stderr)
        return 2
    threads = args.threads or available_cores()
    torch.set_num_threads(threads)
    args.threads = threads
    bs = args.block_size
    per_stream = -(-(args.input_len + args.output_len) // bs) * bs
    need = args.num_prompts * per_stream
    small = max(per_stream, int(need * args.device_fraction) // bs * bs)
    from kvserve.models import resolve_model
    from kvserve.workers.loading.loader import load_model

    vocab = load_model(resolve_model(args.model)).config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    report: dict[str, Any] = {
        "benchmark": "pressure",
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                     "output_len": args.output_len, "peak_kv_tokens": need,
                     "device_kv_tokens": small, "device_fraction": small / need,
                     "block_size": bs, "lookahead": args.lookahead, "policy": args.policy,
                     "restore_policy": args.restore_policy, "rounds": args.rounds,
                     "model": args.model or "default", "seed": args.seed},
        "machine": machine_info(threads),
        "runs": {},
    }
    sizes = {"unconstrained": (need + 4 * bs, 0.0), "recompute": (small, 0.0),
             "host_tier": (small, args.host_gib)}
    llms = {name: make_llm(args, prompts, *sizes[name]) for name in SETTINGS}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = SETTINGS[r % 3:] + SETTINGS[: r % 3]  # each setting takes each slot in turn
        for name in order:
            res, toks = run_once(args, llms[name], prompts, f"{name} {r + 1}/{args.rounds}")
            rounds[name].append(res)
            tokens.setdefault(name, toks)
    runs = report["runs"]
    for name in SETTINGS:
        runs[name] = {**median_run(rounds[name]), "rounds": rounds[name]}
    ref_tokens = tokens["unconstrained"]
    full = runs["unconstrained"]
    for name in ("recompute", "host_tier"):
        runs[name]["match_unconstrained"] = identical(ref_tokens, tokens[name])
        runs[name]["vs_unconstrained"] = _median_ratio(rounds[name], rounds["unconstrained"])
    full["vs_unconstrained"] = 1.0
    host = runs["host_tier"]
    host["vs_recompute"] = _median_ratio(rounds["host_tier"], rounds["recompute"])
    report["restore_vs_recompute"] = restore_vs_recompute(
        llms["host_tier"], args.input_len + args.output_len // 2, args.seed)
    del llms
    if args.baseline == "hf":
        runs["hf_continuous"] = run_hf(args, prompts, small, ref_tokens)
        hf = runs["hf_continuous"]
        if "output_tokens_per_s" in hf:
            host["vs_hf"] = host["output_tokens_per_s"] / hf["output_tokens_per_s"]
    print_report(report)
    write_json(args.json, report)
    return 0


def _median_ratio(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """Median over rounds of a's throughput over b's in the same round."""
    return statistics.median(x["output_tokens_per_s"] / y["output_tokens_per_s"]
                             for x, y in zip(a, b, strict=True))


def run_hf(args: argparse.Namespace, prompts: list[list[int]], kv_tokens: int,
           ref_tokens: list[list[int]]) -> dict[str, Any]:
    from kvserve.bench.common import identical
    from kvserve.bench.hf import load_hf_model, run_hf_continuous

    try:
        import torch

        cuda = torch.cuda.is_available()  # kvserve's own device and dtype there
        model = load_hf_model(args.model, "cuda" if cuda else "cpu",
                              torch.bfloat16 if cuda else torch.float32)
        bs = args.block_size
        cb: dict[str, Any] = {"page_size": bs, "num_blocks": kv_tokens // bs}
        if torch.cuda.is_available():  # HF's own swap-to-host needs pinned memory: CUDA only
            model = model.to("cuda")
            cb["cpu_offload_space"] = args.host_gib if args.host_gib is not None else 4.0
        res, tokens = run_hf_continuous(
            model, prompts, [args.output_len] * len(prompts), cb_config=cb, progress=args.progress,
        )
        res["cpu_offload_space_gib"] = cb.get("cpu_offload_space", 0.0)
    except Exception as e:  # report why it could not run; keep the kvserve figures
        return {"error": f"{type(e).__name__}: {e}"}
    res["kv_cache_tokens"] = kv_tokens
    res["match_unconstrained"] = identical(ref_tokens, tokens)
    return res


def print_report(r: dict[str, Any]) -> None:
    w, m = r["workload"], r["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, {m['torch_threads']} threads")
    print(f"workload: {w['num_prompts']} prompts x {w['input_len']} random tokens -> {w['output_len']} "
          f"tokens each (greedy, EOS ignored); peak KV need {w['peak_kv_tokens']} tokens, device pool "
          f"{w['device_kv_tokens']} ({w['device_fraction']:.0%}); admission lookahead {w['lookahead']}, "
          f"policy {w['policy']}; host tier restores: {w['restore_policy']}; "
          f"{w['rounds']} interleaved rounds (median shown)")
    print(f"{'run':<16}{'KV tok':>8}{'elapsed s':>11}{'out tok/s':>11}{'x uncon':>9}{'evict':>7}"
          f"{'restored':>10}{'recomp':>8}{'failed':>8}{'same':>8}{'cpu/wall':>10}{'other':>7}")
    for name, res in r["runs"].items():
        if "error" in res:
            print(f"{name:<16}  not run: {res['error']}")
            continue
        match = res.get("match_unconstrained")
        same = f"{match['identical']}/{match['of']}" if match else ""
        x = f"{res['vs_unconstrained']:.2f}" if "vs_unconstrained" in res else ""
        other = res.get("other_cores")
        print(f"{name:<16}{res['kv_cache_tokens']:>8}{res['elapsed_s']:>11.2f}"
              f"{res['output_tokens_per_s']:>11.1f}{x:>9}{res.get('evictions', ''):>7}"
              f"{res.get('tokens_restored_copy', ''):>10}{res.get('tokens_recomputed', ''):>8}"
              f"{res.get('failed', ''):>8}{same:>8}{res.get('cpu_per_wall', 0):>10.2f}"
              f"{'' if other is None else f'{other:.2f}':>7}")
        if len(res.get("rounds", ())) > 1:
            print(f"{'':<16}rounds, out tok/s: "
                  + ", ".join(f"{x['output_tokens_per_s']:.1f}" for x in res["rounds"]))
    host = r["runs"]["host_tier"]
    print(f"host tier: {host['vs_unconstrained']:.2f}x unconstrained, {host['vs_recompute']:.2f}x "
          "recompute (medians of the rounds' ratios)"
          + (f", {host['vs_hf']:.2f}x HF continuous batching (same KV budget)" if "vs_hf" in host else ""))
    decisions = ", ".join(f"{k.replace('_', ' ', 1)}: {v}" for k, v in host["restore_decisions"].items())
    print(f"host tier restores: {host['restores_copy']} by copy, {host['restores_recompute']} "
          f"recomputed ({decisions or 'none decided'}); write-backs skipped "
          f"{host['writebacks_skipped']}, demotions skipped {host['demotions_skipped']}")
    if "copy_out_gbps" in host:
        cm = host["cost_model"]
        print(f"host tier copies during the run: device to host {host['copy_out_gbps']:.2f} GB/s "
              f"({host['copy_out_bytes'] / 1e6:.0f} MB), host to device {host['copy_in_gbps']:.2f} GB/s "
              f"({host['copy_in_bytes'] / 1e6:.0f} MB)")
        print(f"cost model at the end: copies {cm['host_copy_gbps_d2h']:.2f} GB/s out, "
              f"{cm['host_copy_gbps_h2d']:.2f} GB/s in; prefill {cm['prefill_tokens_per_s']:.0f} tokens/s")
    c = r["restore_vs_recompute"]
    print(f"per token ({c['tokens']}-token stream): restore by copy {c['restore_s_per_token'] * 1e6:.1f} us "
          f"(out {c['copy_out_s_per_token'] * 1e6:.1f} + in {c['copy_in_s_per_token'] * 1e6:.1f}), "
          f"recompute {c['recompute_s_per_token'] * 1e6:.1f} us: restore is "
          f"{c['recompute_over_restore']:.1f}x cheaper")
    busy = [n for n, res in r["runs"].items() if (res.get("other_cores") or 0) >= 0.25]
    if busy:
        print(f"warning: other processes used 0.25 cores or more during {', '.join(busy)}; "
              "ratios within rounds hold better than absolute rates (re-run on a quiet machine)")
