"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v biases).

Pre-norm layers: x += attn(rms(x)); x += mlp(rms(x)), SwiGLU MLP, RoPE on whole heads
(llama3 or linear scaling), q/k/v and gate/up each fused into one matmul, which matters on
a 2-core CPU where each extra small GEMM costs launch overhead per layer. A sliding
window (Mistral, Qwen2 where configured) applies to the layers the config names.
"""

from __future__ import annotations

import torch

from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.model.attention import LayerAttention
from kvserve.workers.model.layers.decoder import DecoderLayer, DecoderModel
from kvserve.workers.model.layers.mlp import MLP, GatedMLP
from kvserve.workers.model.layers.rope import RotaryEmbedding
from kvserve.workers.model.layers.self_attention import SelfAttention
from kvserve.workers.model.layers.weights import Weights


class LlamaForCausalLM(DecoderModel):
    def __init__(self, cfg: ModelConfig, w: Weights, device: torch.device, dtype: torch.dtype,
                 max_positions: int) -> None:
        super().__init__(cfg, device, dtype)
        self.max_positions = max_positions
        self.build(w)

    def build(self, w: Weights) -> None:
        cfg = self.cfg
        self.embed = w.get("model.embed_tokens.weight")
        self.norm = w.norm("model.norm.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in w
        self.lm_head = w.linear("model.embed_tokens.weight" if tied else "lm_head.weight")
        self.layers = [self.layer(w, i) for i in range(cfg.num_layers)]

    def rope(self, layer: int) -> RotaryEmbedding:
        """The layer's rotary embedding (one table for all layers here)."""
        if not hasattr(self, "_rope"):
            self._rope = RotaryEmbedding(self.cfg, self.max_positions, self.device, self.dtype)
        return self._rope

    def spec(self, layer: int) -> LayerAttention:
        cfg = self.cfg
        return LayerAttention(cfg.attention_scale, cfg.layer_window(layer))

    def attention(self, w: Weights, i: int) -> SelfAttention:
        a = f"model.layers.{i}.self_attn."
        bias = None
        if self.cfg.attention_bias:
            bias = (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
        qkv = w.linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", bias=bias)
        q_norm = k_norm = None
        if self.cfg.qk_norm:
            q_norm, k_norm = w.norm(a + "q_norm.weight"), w.norm(a + "k_norm.weight")
        return SelfAttention(i, self.cfg, qkv, w.linear(a + "o_proj.weight"), self.rope(i),
                             self.spec(i), q_norm, k_norm, heads=w.heads)

    def mlp(self, w: Weights, i: int) -> MLP:
        p = f"model.layers.{i}.mlp."
        gate_up = w.linear(p + "gate_proj.weight", p + "up_proj.weight")
        return GatedMLP(gate_up, w.linear(p + "down_proj.weight"),
                        w.part(self.cfg.intermediate_size), self.cfg.hidden_act)

    def layer(self, w: Weights, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        return DecoderLayer(
            input_norm=w.norm(p + "input_layernorm.weight"),
            attn=self.attention(w, i),
            pre_mlp_norm=w.norm(p + "post_attention_layernorm.weight"),
            mlp=self.mlp(w, i),
        )
