"""Rotary position embeddings (HF rotate-half convention): llama3, linear and longrope
scaling, partial rotation (the leading `rotary_dim` dims of a head), per-layer bases."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.model_config import ModelConfig

log = logging.getLogger(__name__)

_CONFIG: Any = object()  # "take the config's rope_scaling"


def inv_frequencies(cfg: ModelConfig, theta: float | None = None, scaling: Any = _CONFIG,
                    max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, factor on cos and sin) for the rotated dims.

    `theta` / `scaling` override the config's (Gemma 3's local layers); `max_positions`
    is the engine's context, which picks longrope's long or short factors.
    """
    dim = cfg.rotary_dims
    base = cfg.rope_theta if theta is None else theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freq_factors = getattr(cfg, "rope_freqs", None)
    if freq_factors is not None and theta is None:  # GGUF: llama3 scaling as per-dim divisors
        return inv / torch.tensor(freq_factors, dtype=torch.float64), 1.0
    rs = cfg.rope_scaling if scaling is _CONFIG else scaling
    if not rs:
        return inv, 1.0
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(rs["factor"]), 1.0
    if kind == "llama3":
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "longrope":
        return _longrope(cfg, rs, inv, max_positions)
    raise ModelLoadError(f"{cfg.name or 'model'}: rope scaling type {kind!r} is not supported")


def _longrope(cfg: ModelConfig, rs: dict[str, Any], inv: torch.Tensor,
              max_positions: int | None) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-dim divisors, `long_factor` when the engine's context is longer
    than the pre-training one, else `short_factor` (vLLM's rule: one choice per engine, so
    cached KV never mixes the two); cos and sin are scaled by the attention factor."""
    original = int(rs["original_max_position_embeddings"])
    long = max_positions is not None and max_positions > original
    key = "long_factor" if long else "short_factor"
    factors = torch.tensor([float(x) for x in rs[key]], dtype=torch.float64)
    if factors.numel() != inv.numel():
        raise ModelLoadError(
            f"{cfg.name or 'model'}: rope {key} has {factors.numel()} values, expected {inv.numel()}")
    if long:
        log.info("longrope: context %s > %d: using the long factors", max_positions, original)
    attention = rs.get("attention_factor")
    if attention is None:
        factor = rs.get("factor") or float(rs.get("max_position_embeddings", original)) / original
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv / factors, float(attention)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position."""

    # CPU float32 with the C decode step: its RoPE (bound by workers/model/cpu_decode.py)
    lib: Any = None

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype,
                 theta: float | None = None, scaling: Any = _CONFIG):
        inv, attention = inv_frequencies(cfg, theta, scaling, max_positions)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * attention).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention).to(device=device, dtype=dtype)
        self.rotary_dim = cfg.rotary_dims
        self.half = self.rotary_dim // 2
        # the fused CUDA kernel rotates whole heads
        self.whole_heads = self.rotary_dim == cfg.head_dim

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the step's positions, shaped [T, 1, R] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply_in_place(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE of x [T, heads, d] (its heads contiguous) at `positions`, in place, by the C
        step's code: the same bits as that step gives a decode row."""
        t, h, d = x.shape
        assert x.stride(2) == 1 and x.stride(1) == d
        pos = positions if positions.dtype == torch.int64 else positions.long()
        self.lib.ds_rope_rows(x.data_ptr(), t, h, x.stride(0), d, self.cos.data_ptr(),
                              self.sin.data_ptr(), pos.contiguous().data_ptr(), self.rotary_dim,
                              torch.get_num_threads())
        return x

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.whole_heads:
            return _rotate(x, cos, sin, self.half)
        # partial rotary (Phi-4-mini): the trailing dims pass through
        r = self.rotary_dim
        return torch.cat([_rotate(x[..., :r], cos, sin, self.half), x[..., r:]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin
