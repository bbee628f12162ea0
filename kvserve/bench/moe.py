"""`kvserve bench moe`: one Mixture-of-Experts layer, the ways kvserve can run its experts.

Random float32 weights (bfloat16 with --dtype on CUDA) of one MoE block; for each token
count T, the same routed inputs through:
- grouped: kvserve's torch path (layers/moe.py): pairs sorted by expert, one gate/up and one
  down matmul per active expert, weighted rows added back;
- per_token: a naive loop, each token through each of its k experts on its own (what a
  straightforward port does; the yardstick for the grouping);
- fused: the Triton fused-MoE kernels (triton_moe.py), on CUDA only.
Each row gives the median time per call, tokens/s and the largest difference from the
grouped path's output.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from typing import Any

from kvserve.bench.common import machine_info, write_json
from kvserve.hardware import available_cores


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("moe", help="one MoE layer: grouped experts vs a per-token loop (and the "
                                   "fused Triton kernels on CUDA)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--width", type=int, default=384, help="each expert's intermediate size")
    p.add_argument("--tokens", default="1,4,16,64,256", help="token counts T (comma list)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per point (median)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=cmd_moe)


def build(experts: int, top_k: int, hidden: int, width: int, device: str, dtype: Any,
          seed: int) -> Any:
    import torch

    from kvserve.workers.model.layers.mlp import GatedMLP
    from kvserve.workers.model.layers.moe import SparseMoE
    from kvserve.workers.model.quant_linear import Linear

    g = torch.Generator().manual_seed(seed)
    router = torch.randn(experts, hidden, generator=g) * hidden**-0.5
    w13 = torch.randn(experts, 2 * width, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, width, generator=g) * width**-0.5
    router, w13, w2 = (t.to(device, dtype) for t in (router, w13, w2))
    mlps = [GatedMLP(Linear(w13[e]), Linear(w2[e]), width) for e in range(experts)]
    return SparseMoE(router, w13, w2, top_k, True, mlps)


def per_token(moe: Any, x: Any, weights: Any, ids: Any) -> Any:
    """Each token through each of its experts on its own."""
    import torch

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = int(ids[t, j])
            out[t] += weights[t, j] * moe.experts[e](x[t : t + 1])[0]
    return out


def cmd_moe(args: argparse.Namespace) -> int:
    import torch

    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        if min(tokens) < 1 or args.repeats < 1 or not 0 < args.top_k <= args.experts:
            raise ValueError("token counts and --repeats must be >= 1, --top-k in 1..--experts")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device here")
    except ValueError as e:
        print(f"kvserve bench moe: {e}", file=sys.stderr)
        return 2
    threads = args.threads or available_cores()
    torch.set_num_threads(threads)
    dtype = getattr(torch, args.dtype)
    moe = build(args.experts, args.top_k, args.hidden, args.width, args.device, dtype, args.seed)
    cuda = args.device == "cuda"
    g = torch.Generator().manual_seed(args.seed + 1)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    points = []
    for t in tokens:
        x = torch.randn(t, args.hidden, generator=g).to(args.device, dtype)
        with torch.inference_mode():
            weights, ids = moe.route(x)
            paths = {"grouped": partial(moe.grouped, x, weights, ids),
                     "per_token": partial(per_token, moe, x, weights, ids)}
            if cuda:
                from kvserve.workers.model.triton_moe import fused_moe

                paths["fused"] = partial(fused_moe, x, moe.w13, moe.w2, weights, ids)
            want = paths["grouped"]()
            rows = {}
            for name, fn in paths.items():
                got = fn()  # warm-up (and Triton's compile)
                samples = []
                for _ in range(args.repeats):
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    samples.append(time.perf_counter() - t0)
                ms = statistics.median(samples) * 1e3
                rows[name] = {"ms_median": ms, "tokens_per_s": t / ms * 1e3,
                              "max_abs_diff": float((got.float() - want.float()).abs().max())}
        active = int(ids.unique().numel())
        points.append({"tokens": t, "active_experts": active, "results": rows})
    report = {"benchmark": "moe", "machine": machine_info(threads),
              "layer": {"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
                        "width": args.width, "device": args.device, "dtype": args.dtype},
              "points": points}
    print_report(report)
    write_json(args.json, report)
    return 0


def print_report(r: dict[str, Any]) -> None:
    m, lay = r["machine"], r["layer"]
    print(f"machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, {m['torch_threads']} threads")
    print(f"layer: {lay['experts']} experts, top-{lay['top_k']}, hidden {lay['hidden']}, expert "
          f"width {lay['width']}, {lay['dtype']} on {lay['device']}")
    names = list(r["points"][0]["results"])
    head = "".join(f"{n + ' ms':>14}{n + ' tok/s':>17}" for n in names)
    print(f"{'T':>6}{'experts':>9}{head}{'grouped x per_token':>21}")
    for p in r["points"]:
        res = p["results"]
        cells = "".join(f"{res[n]['ms_median']:>14.3f}{res[n]['tokens_per_s']:>17.0f}" for n in names)
        ratio = res["per_token"]["ms_median"] / res["grouped"]["ms_median"]
        print(f"{p['tokens']:>6}{p['active_experts']:>9}{cells}{ratio:>21.2f}")
    worst = max(res["max_abs_diff"] for p in r["points"] for res in p["results"].values())
    print(f"largest difference from the grouped path: {worst:.2e}")
