"""RMSNorm with a float32 weight: plain (Llama) or Gemma's x * (1 + w) form."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm:
    """RMSNorm over the last dim. The weight is kept in float32 with Gemma's `offset`
    (1.0) already added, so both forms are one kernel (torch or the fused CUDA one) and
    the product is taken in float32 and rounded once, as Gemma's reference does."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0) -> None:
        w = weight.float()
        self.weight = w + offset if offset else w
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * self.weight).to(x.dtype)
