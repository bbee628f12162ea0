"""`kvserve bench pressure`: throughput when the device KV pool holds only part of the need.

Every request has a random-token prompt and generates exactly --output-len tokens
(greedy, EOS ignored), so the peak KV need is num_prompts * (input_len + output_len)
tokens when all run at once. In one process, on the same prompts:
- unconstrained: a device pool that holds the whole need;
- recompute: a pool of --device-fraction of the need, no host tier (evicted streams are
  recomputed);
- host tier: the same pool plus the host tier (evicted streams are restored by copy);
- hf_continuous (with --baseline hf): transformers' continuous batching with the same KV
  budget (num_blocks * page_size = the constrained pool). On CPU its swap-to-host
  (`cpu_offload_space`) needs pinned memory, so HF re-prefills the requests it evicts.
It also times, on the host-tier engine, one stream of input_len + output_len / 2 tokens
written back and restored by copy against the same stream recomputed by prefill.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvserve.bench.common import add_async_arg, async_value, write_json

COUNTERS = ("evictions", "restores", "tokens_restored_copy", "tokens_restored_device",
            "tokens_recomputed", "host_prefix_hit_tokens", "copy_bytes")


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
    p.add_argument("--baseline", choices=["hf", "none"], default="hf")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="float32 on a GPU makes outputs comparable across batch compositions")
    p.add_argument("--seed", type=int, default=0)
    add_async_arg(p)
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=cmd_pressure)


def run_kvserve(args: argparse.Namespace, prompts: list[list[int]], kv_tokens: int,
                host_gib: float | None) -> tuple[dict[str, Any], list[list[int]], Any]:
    from kvserve.bench.common import Timer, figures, progress_bar
    from kvserve.llm import LLM
    from kvserve.sampling import SamplingParams

    llm = LLM(model=args.model, kv_cache_tokens=kv_tokens, block_size=args.block_size,
              host_cache_gib=host_gib, admission_lookahead_tokens=args.lookahead,
              preemption_policy=args.policy, max_num_seqs=max(64, len(prompts)),
              num_threads=args.threads, dtype=args.dtype,
              async_scheduling=async_value(args.async_scheduling))
    eng = llm.engine
    n = args.output_len
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate([p[:16] for p in prompts[:2]], params.model_copy(update={"max_tokens": 2, "min_tokens": 2}))
    before = eng.stats()
    with progress_bar(args.progress, len(prompts) * n, "kvserve") as bar:
        inner = eng.step

        def step(finished_only: bool = False) -> list[Any]:
            outs = inner()  # every output, for the bar; LLM.generate wants the finished ones
            bar.update(sum(len(o.delta_token_ids) for o in outs))
            return [o for o in outs if o.finished] if finished_only else outs

        eng.step = step  # type: ignore[method-assign]
        with Timer() as timer:
            outs = llm.generate(prompts, params)
        del eng.step
    after = eng.stats()
    tokens = [o.token_ids for o in outs]
    res = figures(timer, prompts, tokens)
    res.update({k: after[k] - before[k] for k in COUNTERS})
    res["kv_cache_tokens"] = eng.kv.num_blocks * eng.kv.block_size
    res["host_blocks"] = after["host_blocks_total"]
    res["failed"] = sum(o.finish_reason != "length" or len(o.token_ids) != n for o in outs)
    host = eng.kv.host
    if host is not None:
        c = host.copier
        res["copy_out_gbps"] = _gbps(c.blocks["out"] * host.bytes_per_block, c.seconds["out"])
        res["copy_in_gbps"] = _gbps(c.blocks["in"] * host.bytes_per_block, c.seconds["in"])
    return res, tokens, llm


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def restore_vs_recompute(llm: Any, length: int, seed: int, reps: int = 3) -> dict[str, float]:
    """Seconds per token: one stream's blocks copied out and back in vs its prefill."""
    import statistics

    from kvserve.bench.common import random_prompts
    from kvserve.kvcache.manager import StreamStep

    eng = llm.engine
    runner, host = eng.runner, eng.kv.host
    assert host is not None
    ids = random_prompts(1, length, eng.model_config.vocab_size, seed + 1000)[0]
    prefill, copy_out, copy_in = [], [], []
    for r in range(reps):
        sid = f"bench-{r}"
        ids_r = [ids[0] + r + 1] + ids[1:]  # a different first token: no prefix-cache hit
        t0 = time.perf_counter()
        runner.execute([StreamStep(sid, ids_r, length)])
        prefill.append(time.perf_counter() - t0)
        dev = list(eng.kv.block_table(sid))
        hb = host.table.allocate(len(dev))
        t0 = time.perf_counter()
        host.copier.to_host(dev, hb)
        copy_out.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        host.copier.to_device(hb, dev)  # the same content back into the same blocks
        copy_in.append(time.perf_counter() - t0)
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

    if min(args.num_prompts, args.input_len, args.output_len) < 1 or not 0 < args.device_fraction <= 1:
        print("kvserve bench pressure: sizes must be >= 1 and --device-fraction in (0, 1]", file=sys.stderr)
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
                     "model": args.model or "default", "seed": args.seed},
        "machine": machine_info(threads),
        "runs": {},
    }
    runs = report["runs"]
    full, ref_tokens, _ = run_kvserve(args, prompts, need + 4 * bs, 0.0)
    runs["unconstrained"] = full
    rec, rec_tokens, _ = run_kvserve(args, prompts, small, 0.0)
    runs["recompute"] = rec
    host, host_tokens, host_llm = run_kvserve(args, prompts, small, args.host_gib)
    runs["host_tier"] = host
    for name, toks in (("recompute", rec_tokens), ("host_tier", host_tokens)):
        runs[name]["match_unconstrained"] = identical(ref_tokens, toks)
        runs[name]["vs_unconstrained"] = runs[name]["output_tokens_per_s"] / full["output_tokens_per_s"]
    host["vs_recompute"] = host["output_tokens_per_s"] / rec["output_tokens_per_s"]
    report["restore_vs_recompute"] = restore_vs_recompute(
        host_llm, args.input_len + args.output_len // 2, args.seed)
    del host_llm
    if args.baseline == "hf":
        runs["hf_continuous"] = run_hf(args, prompts, small, ref_tokens)
        hf = runs["hf_continuous"]
        if "output_tokens_per_s" in hf:
            host["vs_hf"] = host["output_tokens_per_s"] / hf["output_tokens_per_s"]
    print_report(report)
    write_json(args.json, report)
    return 0


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
          f"policy {w['policy']}")
    print(f"{'run':<16}{'KV tok':>8}{'elapsed s':>11}{'out tok/s':>11}{'x uncon':>9}{'evict':>7}"
          f"{'restored':>10}{'recomp':>8}{'failed':>8}{'same':>8}{'cpu/wall':>10}")
    for name, res in r["runs"].items():
        if "error" in res:
            print(f"{name:<16}  not run: {res['error']}")
            continue
        match = res.get("match_unconstrained")
        same = f"{match['identical']}/{match['of']}" if match else ""
        x = f"{res['vs_unconstrained']:.2f}" if "vs_unconstrained" in res else ""
        print(f"{name:<16}{res['kv_cache_tokens']:>8}{res['elapsed_s']:>11.2f}"
              f"{res['output_tokens_per_s']:>11.1f}{x:>9}{res.get('evictions', ''):>7}"
              f"{res.get('tokens_restored_copy', ''):>10}{res.get('tokens_recomputed', ''):>8}"
              f"{res.get('failed', ''):>8}{same:>8}{res.get('cpu_per_wall', 0):>10.2f}")
    host = r["runs"]["host_tier"]
    print(f"host tier: {host['output_tokens_per_s'] / r['runs']['unconstrained']['output_tokens_per_s']:.2f}x "
          f"unconstrained, {host['vs_recompute']:.2f}x recompute"
          + (f", {host['vs_hf']:.2f}x HF continuous batching (same KV budget)" if "vs_hf" in host else ""))
    if "copy_out_gbps" in host:
        print(f"host tier copies during the run: out {host['copy_out_gbps']:.2f} GB/s, "
              f"in {host['copy_in_gbps']:.2f} GB/s, {host['copy_bytes'] / 1e6:.0f} MB in all")
    c = r["restore_vs_recompute"]
    print(f"per token ({c['tokens']}-token stream): restore by copy {c['restore_s_per_token'] * 1e6:.1f} us "
          f"(out {c['copy_out_s_per_token'] * 1e6:.1f} + in {c['copy_in_s_per_token'] * 1e6:.1f}), "
          f"recompute {c['recompute_s_per_token'] * 1e6:.1f} us: restore is "
          f"{c['recompute_over_restore']:.1f}x cheaper")
