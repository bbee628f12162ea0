"""Qwen3 (dense): the Llama layout with an RMSNorm over each head of q and k before RoPE,
no q/k/v biases and an explicit head_dim (q_proj may be wider than the hidden size).
Sliding-window layers where the config turns them on (use_sliding_window, layer_types)."""

from __future__ import annotations

from kvserve.workers.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    # ModelConfig.qk_norm is set for qwen3 by both loaders; LlamaForCausalLM.attention reads
    # self_attn.q_norm / k_norm then, so the family differs only in its configuration.
    pass
