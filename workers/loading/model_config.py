"""Architecture hyper-parameters of a decoder-only model, independent of file format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# ModelConfig.architecture values; workers/model/models/registry.py maps each to its family
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None = plain RoPE
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    # ---- beyond the Llama family (defaults are Llama's) ----
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (GeGLU)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    rotary_dim: int | None = None  # leading dims of a head that RoPE rotates (None: all)
    # Gemma: embeddings times sqrt(hidden), RMSNorm as x * (1 + w), norms after attention
    # and MLP as well as before, q scaled by query_pre_attn_scalar**-0.5
    embed_scale: float | None = None
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None  # keys a query sees on a sliding layer, itself included
    # per layer, FULL_ATTENTION or SLIDING_ATTENTION; None: every layer full
    layer_types: list[str] | None = None
    # RoPE of the sliding layers where it differs from the global one (Gemma 3)
    rope_local_theta: float | None = None

    @property
    def rotary_dims(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def attention_scale(self) -> float:
        d = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(d) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it attends to the whole context."""
        if self.sliding_window is None or self.layer_types is None:
            return None
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @property
    def all_sliding(self) -> bool:
        return all(self.layer_window(i) is not None for i in range(self.num_layers))
