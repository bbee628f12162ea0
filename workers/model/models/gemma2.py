"""Gemma 2: embeddings times sqrt(hidden), RMSNorm as x * (1 + w), a norm before and after
both attention and MLP, GeGLU (tanh GELU), q scaled by query_pre_attn_scalar**-0.5,
attention scores and final logits soft-capped with tanh, and sliding-window layers
alternating with global ones (even layers slide)."""

from __future__ import annotations

from kvserve.workers.model.attention import LayerAttention
from kvserve.workers.model.layers.decoder import DecoderLayer
from kvserve.workers.model.layers.weights import Weights
from kvserve.workers.model.models.llama import LlamaForCausalLM


class Gemma2ForCausalLM(LlamaForCausalLM):
    """The embedding scale, (1 + w) norms, GeGLU and the final soft-cap come from the
    config (DecoderModel, Weights.norm, GatedMLP); this adds the sandwich norms and the
    attention soft-cap."""

    def spec(self, layer: int) -> LayerAttention:
        cfg = self.cfg
        return LayerAttention(cfg.attention_scale, cfg.layer_window(layer), cfg.attn_logit_softcapping)

    def layer(self, w: Weights, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        return DecoderLayer(
            input_norm=w.norm(p + "input_layernorm.weight"),
            attn=self.attention(w, i),
            post_attn_norm=w.norm(p + "post_attention_layernorm.weight"),
            pre_mlp_norm=w.norm(p + "pre_feedforward_layernorm.weight"),
            mlp=self.mlp(w, i),
            post_mlp_norm=w.norm(p + "post_feedforward_layernorm.weight"),
        )
