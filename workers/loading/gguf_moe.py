"""Mixture-of-Experts parts of a GGUF file (llama.cpp's layout).

llama.cpp writes Qwen3-MoE as `qwen3moe` and Mixtral as `llama` with `llama.expert_count`
set; an MoE layer holds its router as `blk.N.ffn_gate_inp` [E, H] and its experts stacked as
`blk.N.ffn_gate_exps` / `ffn_up_exps` [E, F, H] and `ffn_down_exps` [E, H, F] (torch order),
which are the stacked names kvserve uses (loader.moe_weight_shapes). Metadata:
`{arch}.expert_count`, `{arch}.expert_used_count`, the experts' width in
`{arch}.expert_feed_forward_length` (Qwen3-MoE; Mixtral's experts are `feed_forward_length`
wide) and `{arch}.expert_weights_norm` where a converter states it (llama.cpp renormalises
the top-k weights of both families). A layer without `ffn_gate_inp` has a dense MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.quant_format import QuantizedWeight


def moe_architecture(arch: str, expert_count: int) -> str | None:
    """ModelConfig.architecture of an MoE GGUF, or None for a dense one."""
    if arch == "qwen3moe":
        return "qwen3_moe"
    if arch == "llama" and expert_count > 0:
        return "mixtral"
    return None


def moe_fields(meta: Callable[..., Any], arch: str, num_layers: int, tensors: dict[str, Any],
               dense_width: int, path: str) -> dict[str, Any]:
    """ModelConfig's MoE fields; `meta(suffix, kind, default)` reads `{arch}.{suffix}`."""
    experts = meta("expert_count", int, 0)
    top_k = meta("expert_used_count", int, 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise ModelLoadError(f"{path}: an MoE model needs expert_count > 0 and expert_used_count "
                             f"in 1..expert_count, got {experts} and {top_k}")
    width = meta("expert_feed_forward_length", int, dense_width)
    norm = meta("expert_weights_norm", bool, True)
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
            "norm_topk_prob": norm, "mlp_only_layers": dense}


def expert_rows(hf_name: str, raw: torch.Tensor, qtype: str,
                shape: tuple[int, ...]) -> dict[str, QuantizedWeight]:
    """Raw ggml blocks of a stacked expert tensor [E, rows, row bytes], one 2-D weight per
    expert under its per-expert name (`...mlp.experts.{e}.gate_proj.weight`), for the CPU
    kernel that reads quantized rows as it does for dense layers."""
    prefix, _, proj = hf_name.rpartition(".experts.")
    e, rows, cols = shape
    blocks = raw.view(e, rows, -1)
    return {f"{prefix}.experts.{i}.{proj}": QuantizedWeight(qtype, blocks[i], (rows, cols))
            for i in range(e)}
