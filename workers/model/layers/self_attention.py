"""The attention block of a decoder layer: fused QKV projection, optional per-head q/k
RMSNorm, RoPE, paged attention through the step's backend, output projection."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.model.attention import AttentionBackend, AttentionMetadata, LayerAttention
from kvserve.workers.model.layers.norm import RMSNorm
from kvserve.workers.model.layers.parallel import ReducedLinear
from kvserve.workers.model.layers.rope import RotaryEmbedding
from kvserve.workers.model.quant_linear import Linear


@dataclass
class Step:
    """What every layer of one forward shares."""

    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    cache: DeviceKVCache
    attn: AttentionBackend
    fused: bool  # CUDA: the Triton kernels replace the small torch ops where they fit
    _tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def rope_tables(self, rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the step's positions, gathered once per rope (Gemma 3 has two)."""
        key = id(rope)
        if key not in self._tables:
            self._tables[key] = rope.tables(self.positions)
        return self._tables[key]


class SelfAttention:
    def __init__(self, layer: int, cfg: ModelConfig, qkv: Linear, o: Linear | ReducedLinear,
                 rope: RotaryEmbedding, spec: LayerAttention, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None, heads: tuple[int, int] | None = None) -> None:
        """`heads`: (query, KV) heads this rank computes (a tensor-parallel shard's);
        default: all of the model's."""
        self.layer = layer
        self.qkv, self.o = qkv, o
        self.rope = rope
        self.spec = spec
        self.q_norm, self.k_norm = q_norm, k_norm
        self.hq, self.hkv = heads or (cfg.num_heads, cfg.num_kv_heads)
        self.d = cfg.head_dim
        self.q_size = self.hq * self.d
        self.kv_size = self.hkv * self.d

    def __call__(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        n = h.shape[0]
        hq, hkv, d = self.hq, self.hkv, self.d
        qkv = self.qkv(h)
        if step.fused and self.rope.whole_heads:
            from kvserve.workers.model.triton_fused import rope_cache

            if self.q_norm is not None and self.k_norm is not None:  # in place, before RoPE
                q = qkv[:, : self.q_size].view(n, hq, d)
                k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, hkv, d)
                q.copy_(self.q_norm(q))
                k.copy_(self.k_norm(k))
            kc, vc = step.cache.layer(self.layer)
            q = rope_cache(qkv, step.positions, self.rope.cos, self.rope.sin, kc, vc,
                           step.meta.slot_mapping, hq, hkv, d)
            o = step.attn.attend(self.layer, q, step.cache, step.meta)  # type: ignore[attr-defined]
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = q.view(n, hq, d), k.view(n, hkv, d)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rope.lib is not None and q.dtype == torch.float32 and q.device.type == "cpu":
                # in place: q and k are this step's own (views of qkv, or the norms' outputs)
                q = self.rope.apply_in_place(q, step.positions)
                k = self.rope.apply_in_place(k, step.positions)
            else:
                cos, sin = step.rope_tables(self.rope)
                q = self.rope.apply(q, cos, sin)
                k = self.rope.apply(k, cos, sin)
            o = step.attn.forward(self.layer, q, k, v.reshape(n, hkv, d), step.cache, step.meta)
        return self.o(o.reshape(n, hq * d))
