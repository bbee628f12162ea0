"""A decoder-only transformer over packed, unpadded steps, built by a model family.

Inputs are the concatenated new tokens of every stream in a step ([T]); the per-stream
structure lives only in the attention metadata. A family (workers/model/models/) builds
the embedding, the layers (norms, `SelfAttention`, an `MLP`) and the head from its
weights; this class runs them. On CUDA the small ops run as the Triton kernels of
`triton_fused.py` (residual add + RMSNorm, RoPE + K/V store, SiLU-and-mul) wherever they
fit, the torch ops elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.model.attention import AttentionBackend, AttentionMetadata, LayerAttention
from kvserve.workers.model.layers.mlp import MLP
from kvserve.workers.model.layers.norm import RMSNorm
from kvserve.workers.model.layers.parallel import TensorParallel
from kvserve.workers.model.layers.self_attention import SelfAttention, Step
from kvserve.workers.model.quant_linear import Linear

if TYPE_CHECKING:
    from kvserve.workers.model.cpu_decode import CpuDecodeStep


@dataclass
class DecoderLayer:
    """x += [post_attn_norm](attn(input_norm(x))); x += [post_mlp_norm](mlp(pre_mlp_norm(x))).

    Llama's "post_attention_layernorm" is `pre_mlp_norm`; Gemma adds the two post-norms."""

    input_norm: RMSNorm
    attn: SelfAttention
    pre_mlp_norm: RMSNorm
    mlp: MLP
    post_attn_norm: RMSNorm | None = None
    post_mlp_norm: RMSNorm | None = None


class DecoderModel:
    """Inference-only model; weights are plain tensors (no autograd, no nn.Module state).
    A family's constructor sets `embed`, `layers`, `norm` and `lm_head`."""

    embed: torch.Tensor
    layers: list[DecoderLayer]
    norm: RMSNorm
    lm_head: Linear
    # a tensor-parallel rank's model (set by the registry): `embed` and `lm_head` hold its
    # vocabulary rows, and the forward meets the other ranks there
    tp: TensorParallel | None = None
    # CPU: decode steps as one C call (workers/model/cpu_decode.py), set by the registry
    cpu_step: CpuDecodeStep | None = None

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        # Gemma scales embeddings by sqrt(hidden) rounded to the model's dtype, as HF does
        self.embed_scale = (None if cfg.embed_scale is None
                            else torch.tensor(cfg.embed_scale, dtype=dtype, device=device))
        self.final_softcap = cfg.final_logit_softcapping
        # CUDA: the layer's small ops run as fused Triton kernels (workers/model/triton_fused.py)
        self.fused = device.type == "cuda" and _has_triton()

    @property
    def attention_layers(self) -> list[LayerAttention]:
        """Each layer's attention scale, window and soft-cap, for the attention backend."""
        return [layer.attn.spec for layer in self.layers]

    def _add_norm(self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None,
                  fused: bool) -> torch.Tensor:
        """norm(x), or with `residual`: residual += x (in place), then norm(residual)."""
        if fused:
            from kvserve.workers.model.triton_fused import add_rms_norm

            return add_rms_norm(x, norm.weight, norm.eps, residual)
        if residual is None:
            return norm(x)
        residual.add_(x)
        return norm(residual)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        cache: DeviceKVCache,
        attn: AttentionBackend,
        logits_indices: torch.Tensor,  # [B] rows of T whose logits are wanted
    ) -> torch.Tensor:  # [B, vocab] float32
        cpu_step = self.cpu_step
        if cpu_step is not None and cpu_step.accepts(meta, input_ids.shape[0]):
            x = F.embedding(input_ids, self.embed)
            if self.embed_scale is not None:
                x = x * self.embed_scale
            return self._softcap(cpu_step(x, positions, meta, cache, logits_indices))
        fused = self.fused and hasattr(attn, "attend")
        step = Step(positions, meta, cache, attn, fused)
        tp = self.tp
        # the residual stream, updated in place
        res = F.embedding(input_ids, self.embed) if tp is None else tp.embed(input_ids, self.embed)
        if self.embed_scale is not None:
            res = res * self.embed_scale
        delta: torch.Tensor | None = None  # the last MLP output, added before the next norm
        for layer in self.layers:
            if delta is None:
                h = self._add_norm(res, layer.input_norm, None, fused)
            else:
                h = self._add_norm(delta, layer.input_norm, res, fused)
            a = layer.attn(h, step)
            if layer.post_attn_norm is not None:
                a = self._add_norm(a, layer.post_attn_norm, None, fused)
            h = self._add_norm(a, layer.pre_mlp_norm, res, fused)
            delta = layer.mlp(h, fused)
            if layer.post_mlp_norm is not None:
                delta = self._add_norm(delta, layer.post_mlp_norm, None, fused)
        assert delta is not None
        last = res[logits_indices] + delta[logits_indices]
        logits = self.lm_head(self._add_norm(last, self.norm, None, fused))
        if tp is not None:
            logits = tp.gather_logits(logits)
        return self._softcap(logits.float())

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
