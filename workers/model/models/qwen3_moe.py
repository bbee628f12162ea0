"""Qwen3-MoE: Qwen3's attention (q/k head norms, explicit head_dim) with a sparse
Mixture-of-Experts MLP (layers/moe.py) on the layers the config makes sparse; the layers of
mlp_only_layers, or off the decoder_sparse_step, keep a dense SwiGLU MLP."""

from __future__ import annotations

from kvserve.workers.model.layers.mlp import MLP
from kvserve.workers.model.layers.moe import build_moe
from kvserve.workers.model.layers.weights import Weights
from kvserve.workers.model.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def mlp(self, w: Weights, i: int) -> MLP:
        return build_moe(w, i) if self.cfg.is_moe_layer(i) else super().mlp(w, i)
