"""Gemma 3 (text): Gemma 2's layout with an RMSNorm ((1 + w) form) over each head of q and
k, no attention soft-cap, five sliding-window layers per global one (sliding_window_pattern
or layer_types), and RoPE per layer type: the global layers use rope_theta with the
config's scaling (linear on the larger models), the sliding ones rope_local_base_freq
unscaled."""

from __future__ import annotations

from kvserve.workers.model.attention import LayerAttention
from kvserve.workers.model.layers.rope import RotaryEmbedding
from kvserve.workers.model.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def rope(self, layer: int) -> RotaryEmbedding:
        cfg = self.cfg
        if cfg.layer_window(layer) is None or cfg.rope_local_theta is None:
            return super().rope(layer)
        if not hasattr(self, "_local_rope"):
            self._local_rope = RotaryEmbedding(cfg, self.max_positions, self.device, self.dtype,
                                               theta=cfg.rope_local_theta, scaling=None)
        return self._local_rope

    def spec(self, layer: int) -> LayerAttention:
        # transformers' Gemma 3 attention takes no soft-cap, whatever the config says
        return LayerAttention(self.cfg.attention_scale, self.cfg.layer_window(layer))
