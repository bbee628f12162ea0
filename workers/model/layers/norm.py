"""RMSNorm with a float32 weight: plain (Llama) or Gemma's x * (1 + w) form."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class RMSNorm:
    """RMSNorm over the last dim. The weight is kept in float32 with Gemma's `offset`
    (1.0) already added, so both forms are one kernel (torch or the fused CUDA one) and
    the product is taken in float32 and rounded once, as Gemma's reference does."""

    # CPU float32 with the C decode step: its row norm (workers/model/cpu_decode.py binds it),
    # so a row is normed the same way in and out of that step
    lib: Any = None

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0) -> None:
        w = weight.float()
        self.weight = w + offset if offset else w
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if self.lib is not None and x.device.type == "cpu":
                return _rms_norm_c(x, self.weight, self.eps, self.lib)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * self.weight).to(x.dtype)


def _rms_norm_c(x: torch.Tensor, w: torch.Tensor, eps: float, lib: Any) -> torch.Tensor:
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    lib.ds_rms_norm_rows(rows.data_ptr(), rows.stride(0), w.data_ptr(), out.data_ptr(), n,
                         rows.shape[0], n, eps, torch.get_num_threads())
    return out.view(x.shape)
