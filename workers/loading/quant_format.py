"""ggml quantized weights as loaded from GGUF: the raw blocks of a 2-D weight and its type.

The CPU kernels read these blocks in place: csrc/qgemm.c (8-bit activations) every type
here, csrc/qgemv.c (float32 activations, the exact path) the 32-weight ones
(`EXACT_QTYPES`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ggml type name -> (type id, weights per block, bytes per block)
QTYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210),
}
EXACT_QTYPES = ("Q4_0", "Q4_1", "Q8_0")


@dataclass
class QuantizedWeight:
    """Raw ggml blocks of a 2-D weight, one row of blocks per output feature."""

    qtype: str  # a key of QTYPES
    data: torch.Tensor  # uint8 [N, K // block weights * block bytes], contiguous
    shape: tuple[int, int]  # (N, K) of the dequantized weight

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.qtype not in QTYPES or k % QTYPES[self.qtype][1]:
            raise ValueError(f"unsupported quantized weight {self.qtype} {self.shape}")
        _, block, size = QTYPES[self.qtype]
        if tuple(self.data.shape) != (n, k // block * size):
            raise ValueError(f"raw rows {tuple(self.data.shape)} do not match {self.qtype} {self.shape}")


def concat_rows(parts: list[QuantizedWeight | None]) -> QuantizedWeight | None:
    """Fuse weights along output rows, as torch.cat does for their float forms; None
    unless every part is quantized with one type and the same K."""
    if not parts or any(p is None for p in parts):
        return None
    qs = [p for p in parts if p is not None]
    if len({(p.qtype, p.shape[1]) for p in qs}) != 1:
        return None
    data = qs[0].data if len(qs) == 1 else torch.cat([p.data for p in qs])
    return QuantizedWeight(qs[0].qtype, data.contiguous(), (sum(p.shape[0] for p in qs), qs[0].shape[1]))
