"""ggml quantized weights as loaded from GGUF: the raw blocks of a 2-D weight and its type.

The CPU kernels read these blocks in place: csrc/qgemm.c (8-bit activations) every type
here, csrc/qgemv.c (float32 activations, the exact path) the 32-weight ones
(`EXACT_QTYPES`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# ggml type name -> (type id, weights per block, bytes per block)
QTYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}
EXACT_QTYPES = ("Q4_0", "Q4_1", "Q8_0")
# Types whose every block is a Q8_0 block exactly (the same f16 scale; each weight an int8
# multiple of it): the loader rewrites them as Q8_0 so the kernels run them. They turn up
# beside Q4_K in the Q4_K_M files of models whose widths are no multiple of 256 (llama.cpp
# falls back to Q5_0 there, and to IQ4_NL for the lower K-quants and i-quants). The rows
# grow from 22 or 18 bytes a block to 34; their float fallback took 128.
AS_Q8_0 = ("Q5_0", "IQ4_NL")
_IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                          dtype=np.int8)


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


def as_q8_0(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Raw blocks of a type in AS_Q8_0 (rows of blocks, any leading dimensions) rewritten as
    the Q8_0 blocks of the same values: gguf dequantizes both to the same float32 bits."""
    size = {"Q5_0": 22, "IQ4_NL": 18}[qtype]
    lead, row = raw.shape[:-1], raw.shape[-1]
    b = np.ascontiguousarray(raw).reshape(-1, size)
    qs = b[:, size - 16:]  # weight j in the low nibble of byte j, weight j + 16 in the high one
    nib = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    if qtype == "Q5_0":  # bit j of qh is weight j's fifth bit; the weights are q - 16
        qh = b[:, 2:6].copy().view("<u4")
        bits = (qh >> np.arange(32, dtype=np.uint32)) & 1
        q = (nib.astype(np.int16) | (bits.astype(np.int16) << 4)) - 16
    else:  # IQ4_NL: each nibble indexes a fixed table of int8 values
        q = _IQ4_NL_VALUES[nib]
    out = np.empty((b.shape[0], 34), np.uint8)
    out[:, :2] = b[:, :2]  # the f16 scale
    out[:, 2:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(*lead, row // size * 34)
