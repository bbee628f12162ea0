"""Mixtral: the Mistral layout (Llama's, with a sliding window where the config sets one)
with a sparse Mixture-of-Experts MLP (layers/moe.py) on every layer, the top-k router
weights always renormalised."""

from __future__ import annotations

from kvserve.workers.model.layers.mlp import MLP
from kvserve.workers.model.layers.moe import build_moe
from kvserve.workers.model.layers.weights import Weights
from kvserve.workers.model.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    def mlp(self, w: Weights, i: int) -> MLP:
        return build_moe(w, i) if self.cfg.is_moe_layer(i) else super().mlp(w, i)
