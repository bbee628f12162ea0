"""Linear layers read straight from ggml-quantized rows (Q4_0, Q4_1, Q8_0) at small batch.

Batch-1 decode on the CPU is bound by reading the weights: the float32 expansion of
a Q4_1 model is ~7x the bytes of its blocks. For a few activation rows the C kernel
(csrc/qgemv.c) reads the blocks instead; larger batches go to MKL's fp32 GEMM, which
is compute-bound there and faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.workers.loading.quant_format import QTYPES, QuantizedWeight

# Largest activation row count sent to the kernel. Its FMA work grows with the rows
# while MKL's fp32 GEMM reads the expanded weights once; SmolLM2-135M decode on a
# 2-core Zen3: 2.4x faster steps at 1 stream, 1.6x at 16, break-even near 24.
MAX_ROWS = 16


def qlinear(x: torch.Tensor, qw: QuantizedWeight, lib: object) -> torch.Tensor:
    """x [M, K] float32 @ dequant(qw)^T -> [M, N], via the compiled kernel `lib`."""
    x = x.contiguous()
    n, k = qw.shape
    m = x.shape[0]
    out = torch.empty((m, n), dtype=torch.float32)
    rc = lib.qgemv_f32(  # type: ignore[attr-defined]
        QTYPES[qw.qtype][0], qw.data.data_ptr(), n, k, qw.data.shape[1],
        x.data_ptr(), m, out.data_ptr(), torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"qgemv_f32 rejected a {qw.qtype} {qw.shape} weight (rc={rc})")
    return out


class Linear:
    """A float weight with optional raw quantized rows; picks the path by batch rows."""

    __slots__ = ("weight", "bias", "quant", "lib", "max_rows")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        quant: QuantizedWeight | None = None,
        lib: object | None = None,
        max_rows: int = MAX_ROWS,
    ) -> None:
        self.weight = weight
        self.bias = bias
        # the kernel is float32-on-CPU only; anything else keeps the torch path
        usable = lib is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
        self.quant = quant if usable else None
        self.lib = lib
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and x.dim() == 2 and x.shape[0] <= self.max_rows:
            out = qlinear(x, self.quant, self.lib)
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)
