"""The fused-MoE Triton kernels against the grouped torch path on one GPU, bf16.

Usage: python scripts/gpu/moe_kernels.py [--tokens 1,8,64,256,1024,4096]
For two expert shapes (Qwen3-30B-A3B's layer: 128 experts of 2048 -> 768, top-8; Mixtral
8x7B's: 8 experts of 4096 -> 14336, top-2) and each token count T: the largest difference
of the two paths' outputs (relative to the output's scale) and of each against a float32
run of the grouped path (with the bf16 routing), then the time per call of the grouped path (eager: it syncs on
the expert counts), the fused path eager and the fused path replayed from a CUDA graph
(which is how decode steps run it), with the bytes of expert weights the step touches
over that time.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from kvserve.workers.model.layers.mlp import GatedMLP
from kvserve.workers.model.layers.moe import SparseMoE
from kvserve.workers.model.quant_linear import Linear

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


def make(e: int, k: int, h: int, f: int, dtype: torch.dtype, g: torch.Generator) -> SparseMoE:
    dev = "cuda"
    router = (torch.randn(e, h, generator=g) * 0.03).to(dev, dtype)
    w13 = (torch.randn(e, 2 * f, h, generator=g) * h**-0.5).to(dev, dtype)
    w2 = (torch.randn(e, h, f, generator=g) * f**-0.5).to(dev, dtype)
    experts = [GatedMLP(Linear(w13[i]), Linear(w2[i]), f) for i in range(e)]
    return SparseMoE(router, w13, w2, k, True, experts)


def run_grouped(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The grouped torch path (what the CPU runs; it syncs on the expert counts)."""
    return moe.grouped(x, *moe.route(x))


def timed(fn, reps: int) -> float:
    """ms per call, by CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, (e, k, h, f) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        moe = make(e, k, h, f, torch.bfloat16, g)
        w13, w2 = moe.w13.float(), moe.w2.float()
        ref = SparseMoE(moe.router.float(), w13, w2, k, True,
                        [GatedMLP(Linear(w13[i]), Linear(w2[i]), f) for i in range(e)])
        print(f"== {name}: {e} experts, top-{k}, hidden {h}, expert width {f}")
        print(f"{'T':>6}{'fused-grouped':>15}{'fused-fp32':>12}{'grouped-fp32':>14}"
              f"{'grouped ms':>12}{'fused ms':>10}{'graph ms':>10}{'graph GB/s':>12}{'x grouped':>11}")
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, h, generator=g).to("cuda", torch.bfloat16)
            with torch.inference_mode():
                fused = moe(x).float()
                grouped = run_grouped(moe, x).float()
                weights, ids = moe.route(x)  # the same experts for the float32 reference
                exact = ref.grouped(x.float(), weights.float(), ids)
                scale = exact.abs().max().item()
                touched = ids.unique().numel() * 3 * h * f * 2  # bytes of the experts it reads
                ms_g = timed(partial(run_grouped, moe, x), 20)
                ms_f = timed(partial(moe, x), 20)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    moe(x)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    moe(x)
                ms_c = timed(graph.replay, 50)
            print(f"{t:>6}{(fused - grouped).abs().max().item() / scale:>15.2e}"
                  f"{(fused - exact).abs().max().item() / scale:>12.2e}"
                  f"{(grouped - exact).abs().max().item() / scale:>14.2e}"
                  f"{ms_g:>12.3f}{ms_f:>10.3f}{ms_c:>10.3f}{touched / ms_c / 1e6:>12.0f}"
                  f"{ms_g / ms_c:>11.2f}")


if __name__ == "__main__":
    main()
