"""The sparse Mixture-of-Experts MLP (Qwen3-MoE, Mixtral): it takes a dense MLP's place in
a decoder layer (the `MLP` call).

Router: logits = x @ gate^T, softmax in float32, the top-k experts per token, their
probabilities renormalised to sum to 1 where the model says (Mixtral always; Qwen3-MoE by
norm_topk_prob). Each expert is a SiLU-gated MLP; a token's output is the weighted sum of its
k experts' outputs.

Two ways to run the experts, chosen by the device (`kernel`):
- fused (CUDA with Triton, every step whatever the attention backend): the kernels of
  `triton_moe.py`, with fixed shapes and no host synchronisation, so decode steps stay
  capturable in CUDA graphs;
- grouped (the CPU, and CUDA without Triton): the (token, expert) pairs are sorted by
  expert and each active expert runs once over its rows (one gate/up and one down matmul per
  expert per step, through `Linear`, so GGUF experts use the quantized-row kernel at small
  batch as dense layers do), then the weighted rows are added back to their tokens. It reads
  the per-expert counts on the host, so it cannot be captured; it only runs where no graphs
  are (they need the Triton attention backend), and refuses to run inside a capture.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.workers.loading.quant_format import concat_rows
from kvserve.workers.model.layers.mlp import GatedMLP
from kvserve.workers.model.layers.weights import Weights
from kvserve.workers.model.quant_linear import Linear


class SparseMoE:
    def __init__(self, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                 renormalize: bool, experts: list[GatedMLP],
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`reduce`: a tensor-parallel rank's experts hold its share of every expert's width,
        so their outputs are partial sums, added over the ranks once per block."""
        self.router = router  # [E, H]
        self.w13 = w13  # [E, 2F, H]: each expert's [gate | up] rows
        self.w2 = w2  # [E, H, F]
        self.top_k = top_k
        self.renormalize = renormalize
        self.experts = experts  # views of w13 / w2 (with quantized rows where loaded)
        self.num_experts = router.shape[0]
        self.kernel = router.is_cuda and _has_triton()
        self.reduce = reduce

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) as transformers computes them."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def __call__(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.kernel:
            from kvserve.workers.model.triton_moe import fused_moe

            out = fused_moe(x, self.w13, self.w2, weights, ids)
        else:
            out = self.grouped(x, weights, ids)
        return out if self.reduce is None else self.reduce(out)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each active expert once over the rows routed to it."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the grouped MoE path reads expert counts on the host and "
                               "cannot run inside a CUDA graph; the fused kernels can")
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // self.top_k  # the token of each sorted pair
        xs = x[rows]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self.experts[e](xs[start : start + n])
                start += n
        ys.mul_(weights.flatten()[order].unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, rows, ys)


def build_moe(w: Weights, layer: int) -> SparseMoE:
    """Layer `layer`'s MoE block from the stacked weights the loaders return."""
    cfg = w.cfg
    p = f"model.layers.{layer}.mlp."
    gate, up = w.get(p + "experts.gate_proj.weight"), w.get(p + "experts.up_proj.weight")
    w13 = torch.cat([gate, up], dim=1).contiguous()
    w2 = w.get(p + "experts.down_proj.weight").contiguous()
    f = w.part(cfg.moe_intermediate_size)  # a tensor-parallel rank's share of each expert
    experts = []
    for e in range(cfg.num_experts):
        q = f"{p}experts.{e}."
        gate_up = Linear(w13[e], None, concat_rows([w.qw.get(q + "gate_proj.weight"),
                                                    w.qw.get(q + "up_proj.weight")]), w.lib,
                         int8=w.int8)
        down = Linear(w2[e], None, w.qw.get(q + "down_proj.weight"), w.lib, int8=w.int8)
        experts.append(GatedMLP(gate_up, down, f, "silu"))
    return SparseMoE(w.get(p + "gate.weight"), w13, w2, cfg.num_experts_per_tok,
                     cfg.norm_topk_prob, experts, None if w.tp is None else w.reduce)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
