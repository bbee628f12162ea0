"""Linear layers read straight from ggml-quantized rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).

Two kernels, chosen by EngineConfig.cpu_matmul:

- `int8` (csrc/qgemm.c): the activations are quantized to 8 bits per 32 values once per
  matmul and multiplied with the blocks by integer dot products, at every row count (so a
  row's result does not depend on what it is batched with). Batch-1 decode reads the blocks
  (~7x fewer bytes than their float32 expansion); large batches and prefill run integer
  arithmetic at about twice MKL's float32 rate on this kind of host.
- `exact` (csrc/qgemv.c): float32 activations; each block is dequantized exactly as gguf
  does and reused by every row. Up to MAX_ROWS rows; larger batches go to MKL's float32
  GEMM on the dequantized weights, which is compute-bound there and faster.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from kvserve.workers.loading.quant_format import EXACT_QTYPES, QTYPES, QuantizedWeight

# Largest activation row count sent to the exact kernel. Its FMA work grows with the rows
# while MKL's fp32 GEMM reads the expanded weights once; SmolLM2-135M decode on a
# 2-core Zen3: 2.4x faster steps at 1 stream, 1.6x at 16, break-even near 24.
MAX_ROWS = 16

_scratch = threading.local()


def scratch(nbytes: int) -> torch.Tensor:
    """A reusable uint8 buffer of at least `nbytes` for this thread (grown, never shrunk:
    a prefill-sized buffer allocated per call would be page-faulted in every time)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
        _scratch.buf = buf
    return buf


def qlinear(x: torch.Tensor, qw: QuantizedWeight, lib: object) -> torch.Tensor:
    """x [M, K] float32 @ dequant(qw)^T -> [M, N], float32 activations (csrc/qgemv.c)."""
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


def qlinear_int8(x: torch.Tensor, qw: QuantizedWeight, lib: object) -> torch.Tensor:
    """x [M, K] float32 @ dequant(qw)^T -> [M, N] with 8-bit activations (csrc/qgemm.c)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, k = qw.shape
    m = x.shape[0]
    out = torch.empty((m, n), dtype=torch.float32)
    buf = scratch(lib.qgemm_scratch_bytes(m, k))  # type: ignore[attr-defined]
    rc = lib.qgemm_q8(  # type: ignore[attr-defined]
        QTYPES[qw.qtype][0], qw.data.data_ptr(), n, k, qw.data.shape[1], x.data_ptr(),
        x.stride(0), m, out.data_ptr(), buf.data_ptr(), torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"qgemm_q8 rejected a {qw.qtype} {qw.shape} weight (rc={rc})")
    return out


def _kernel_runs(lib: object | None, device: torch.device, dtype: torch.dtype) -> bool:
    return lib is not None and device.type == "cpu" and dtype == torch.float32


class Linear:
    """A float weight with optional raw quantized rows and the kernel that reads them;
    `int8`: the kernel is csrc/qgemm.c's (every row count), else csrc/qgemv.c's (up to
    `max_rows` rows, the float weight above). Where the int8 kernel reads every row the
    weight may be a meta tensor (its shape only: layers/weights.py makes none)."""

    __slots__ = ("weight", "bias", "quant", "parts", "lib", "max_rows", "int8")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        quant: QuantizedWeight | None = None,
        lib: object | None = None,
        max_rows: int = MAX_ROWS,
        int8: bool = False,
        parts: tuple[QuantizedWeight, ...] | None = None,
    ) -> None:
        self.weight = weight
        self.bias = bias
        # the kernels are float32-on-CPU only; anything else keeps the torch path
        device = torch.device("cpu") if weight.is_meta else weight.device
        usable = _kernel_runs(lib, device, weight.dtype)
        if not int8 and any(q.qtype not in EXACT_QTYPES for q in (quant, *(parts or ())) if q is not None):
            usable = False
        self.quant = quant if usable else None
        # rows stacked from weights of different types (quant None): each part's own kernel
        self.parts = parts if usable and quant is None and parts else None
        self.lib = lib
        self.max_rows = max_rows
        self.int8 = int8 and (self.quant is not None or self.parts is not None)
        if weight.is_meta and not self.int8:
            raise ValueError("a linear without its float weight needs the int8 kernel on its blocks")

    @staticmethod
    def int8_reads_blocks(lib: object | None, device: torch.device, dtype: torch.dtype, int8: bool,
                          quant: QuantizedWeight | None, parts: tuple[QuantizedWeight, ...] | None) -> bool:
        """Whether a Linear so made multiplies every row through the int8 kernel (and so
        never reads its float weight)."""
        return int8 and (quant is not None or bool(parts)) and _kernel_runs(lib, device, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 and x.dim() != 2:  # the kernel takes rows
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        if self.parts is not None and x.dim() == 2 and (self.int8 or x.shape[0] <= self.max_rows):
            run = qlinear_int8 if self.int8 else qlinear
            out = torch.cat([run(x, q, self.lib) for q in self.parts], dim=1)
            return out if self.bias is None else out.add_(self.bias)
        if self.quant is not None and x.dim() == 2:
            if self.int8:
                out = qlinear_int8(x, self.quant, self.lib)
                return out if self.bias is None else out.add_(self.bias)
            if x.shape[0] <= self.max_rows:
                out = qlinear(x, self.quant, self.lib)
                return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)
