"""Phi-3 and Phi-4-mini: the Llama layout with q/k/v stored as one qkv_proj and gate/up as
one gate_up_proj (already the fused matmuls kvserve runs), RoPE on the leading
partial_rotary_factor of each head (Phi-4-mini: 3/4), LongRoPE scaling where the config
has it, and a sliding window on every layer where the config sets one."""

from __future__ import annotations

from kvserve.workers.model.layers.mlp import MLP, GatedMLP
from kvserve.workers.model.layers.self_attention import SelfAttention
from kvserve.workers.model.layers.weights import Weights
from kvserve.workers.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def attention(self, w: Weights, i: int) -> SelfAttention:
        a = f"model.layers.{i}.self_attn."
        return SelfAttention(i, self.cfg, w.linear(a + "qkv_proj.weight"),
                             w.linear(a + "o_proj.weight"), self.rope(i), self.spec(i),
                             heads=w.heads)

    def mlp(self, w: Weights, i: int) -> MLP:
        p = f"model.layers.{i}.mlp."
        return GatedMLP(w.linear(p + "gate_up_proj.weight"), w.linear(p + "down_proj.weight"),
                        w.part(self.cfg.intermediate_size), self.cfg.hidden_act)
