"""Mixture-of-Experts parts of a Hugging Face checkpoint: the config keys and the experts.

kvserve holds an MoE layer's experts stacked, under the names of `moe_weight_shapes`
(`model.layers.{i}.mlp.experts.gate_proj.weight` [E, F, H], ...), for Qwen3-MoE and Mixtral
alike. Published checkpoints store one tensor per expert (Qwen3-MoE
`mlp.experts.{e}.gate_proj.weight`; Mixtral `block_sparse_moe.experts.{e}.w1.weight`, w3
the up and w2 the down projection, and `block_sparse_moe.gate` the router); transformers >= 5
holds them fused in memory (`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj`),
which a checkpoint may carry as well. `expert_views` says how each stacked tensor is made
from the file's tensors, so shapes are checked before any data is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.model_config import ModelConfig

# per-expert file names: (router, {our projection: the file's}) by architecture
_PER_EXPERT = {
    "qwen3_moe": ("mlp.gate", "mlp.experts.{e}.", {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                                   "down_proj": "down_proj"}),
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.",
                {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
}


def moe_fields(raw: dict[str, Any], arch: str, num_layers: int, source: str) -> dict[str, Any]:
    """ModelConfig's MoE fields from config.json (empty for a dense architecture)."""
    if arch not in _PER_EXPERT:
        return {}

    def count(key: str, default: int | None = None) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelLoadError(f"{source}: key {key!r} must be a non-negative integer, got {value!r}")
        return value

    # Qwen3-MoE's configs say num_experts, Mixtral's num_local_experts; transformers >= 5
    # writes either name for both
    key = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    experts = count(key, 8 if arch == "mixtral" else 128)
    if arch == "mixtral":  # every layer sparse; experts as wide as intermediate_size
        inter, norm, dense = count("intermediate_size"), True, []
    else:
        inter = count("moe_intermediate_size", 768)
        norm = raw.get("norm_topk_prob", False)  # transformers' default for Qwen3-MoE
        if not isinstance(norm, bool):
            raise ModelLoadError(f"{source}: norm_topk_prob must be true or false, got {norm!r}")
        step = count("decoder_sparse_step", 1)
        only = raw.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                 for i in only):
            raise ModelLoadError(f"{source}: mlp_only_layers must be a list of layer indices")
        # transformers' rule: sparse where not listed and (i + 1) is a multiple of the step
        dense = [i for i in range(num_layers) if i in only or step == 0 or (i + 1) % step]
    top_k = count("num_experts_per_tok", 2 if arch == "mixtral" else 8)
    if experts and not 0 < top_k <= experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok {top_k} must be in 1..{experts}")
    if experts and inter <= 0:
        raise ModelLoadError(f"{source}: the experts' intermediate size must be positive")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
            "norm_topk_prob": norm, "mlp_only_layers": dense}


@dataclass
class ExpertView:
    """A stacked tensor kvserve wants, made from `keys` in the file by `make`."""

    keys: list[str]
    shape: tuple[int, ...]
    make: Callable[[list[torch.Tensor]], torch.Tensor]
    per_expert: bool = False  # `make` stacks one tensor per expert (a split applies to each)

    def load(self, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        try:
            return self.make([get(k) for k in self.keys])
        except RuntimeError as e:  # torch.stack / slicing of tensors that disagree
            raise ModelLoadError(f"cannot assemble experts from {self.keys[0]} ...: {e}") from e


def expert_views(cfg: ModelConfig, keys: set[str], shape: Callable[[str], tuple[int, ...]],
                 source: str) -> dict[str, ExpertView]:
    """How each stacked MoE tensor (router included, where the file names it otherwise) is
    read from a checkpoint whose tensor names are `keys`; names the file holds as they are
    need no view."""
    if cfg.architecture not in _PER_EXPERT:
        return {}
    router, expert, projections = _PER_EXPERT[cfg.architecture]
    views: dict[str, ExpertView] = {}
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        p = f"model.layers.{i}."
        ours = p + "mlp."
        if ours + "gate.weight" not in keys and p + router + ".weight" in keys:
            name = p + router + ".weight"
            views[ours + "gate.weight"] = ExpertView([name], shape(name), lambda t: t[0])
        fused_gu, fused_down = ours + "experts.gate_up_proj", ours + "experts.down_proj"
        if fused_gu in keys:  # transformers' fused layout: [gate | up] rows per expert
            e, two_f, h = shape(fused_gu)
            f = two_f // 2
            views[ours + "experts.gate_proj.weight"] = ExpertView(
                [fused_gu], (e, f, h), lambda t, f=f: t[0][:, :f].contiguous())
            views[ours + "experts.up_proj.weight"] = ExpertView(
                [fused_gu], (e, two_f - f, h), lambda t, f=f: t[0][:, f:].contiguous())
        if fused_down in keys:
            views[ours + "experts.down_proj.weight"] = ExpertView([fused_down], shape(fused_down),
                                                                  lambda t: t[0])
        for mine, theirs in projections.items():
            target = f"{ours}experts.{mine}.weight"
            if target in views or target in keys:
                continue
            names = [f"{p}{expert.format(e=e)}{theirs}.weight" for e in range(cfg.num_experts)]
            present = [n for n in names if n in keys]
            if not present:
                continue  # reported as the stacked name missing
            if len(present) < len(names):
                missing = [n for n in names if n not in keys]
                raise ModelLoadError(f"{source}: missing expert tensors {', '.join(missing[:3])}"
                                     f"{' ...' if len(missing) > 3 else ''}")
            shapes = {shape(n) for n in names}
            if len(shapes) != 1:
                raise ModelLoadError(f"{source}: experts of {p}{theirs} differ in shape: {sorted(shapes)}")
            views[target] = ExpertView(names, (len(names), *shapes.pop()), torch.stack, True)
    return views
