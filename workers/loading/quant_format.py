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
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}
EXACT_QTYPES = ("Q4_0", "Q4_1", "Q8_0")
# Types whose every block is a Q8_0 block exactly (the same f16 scale; each weight an int8
# multiple of it): the loader rewrites them as Q8_0 so the kernels run them. IQ4_NL turns
# up in the Q3_K_M files of models whose widths are no multiple of 256 (llama.cpp's
# fallback for the lower K-quants and i-quants there; for Q4_K it is Q5_0, which the kernels
# read as it is). The rows grow from 18 bytes a block to 34; their float fallback took 128.
AS_Q8_0 = ("IQ4_NL",)
# Types whose every block is a Q6_K block exactly. Q3_K's weights are d * (sc - 32) * (q - 4)
# with a 6-bit scale per 16 and q - 4 in [-4, 3]; Q6_K's are d * sc * (q - 32) with an int8
# scale per 16 and a 6-bit q: the same d, sc - 32 and q + 28 give the same products (gguf
# dequantizes both to the same float32 bits). The loader rewrites Q3_K (most of a Q3_K_M or
# Q3_K_S file) as Q6_K so the int8 kernels run it: 210 bytes a block instead of 110, where
# the float fallback read 1024.
AS_Q6_K = ("Q3_K",)
REWRITTEN = (*AS_Q8_0, *AS_Q6_K)
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


def as_kernel_type(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, str]:
    """Raw blocks and their type as the kernels take them: a type of REWRITTEN as the blocks
    of the same values in Q8_0 or Q6_K, any other as it is."""
    if qtype in AS_Q8_0:
        return as_q8_0(raw), "Q8_0"
    if qtype in AS_Q6_K:
        return as_q6_k(raw), "Q6_K"
    return raw, qtype


def as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Raw IQ4_NL blocks (rows of blocks, any leading dimensions) rewritten as the Q8_0 blocks
    of the same values: gguf dequantizes both to the same float32 bits."""
    lead, row = raw.shape[:-1], raw.shape[-1]
    b = np.ascontiguousarray(raw).reshape(-1, 18)
    qs = b[:, 2:]  # weight j in the low nibble of byte j, weight j + 16 in the high one
    q = _IQ4_NL_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=1)]  # a fixed table of int8 values
    out = np.empty((b.shape[0], 34), np.uint8)
    out[:, :2] = b[:, :2]  # the f16 scale
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(*lead, row // 18 * 34)


def as_q6_k(raw: np.ndarray) -> np.ndarray:
    """Raw Q3_K blocks (rows of blocks, any leading dimensions) rewritten as the Q6_K blocks
    of the same values."""
    lead, row = raw.shape[:-1], raw.shape[-1]
    b = np.ascontiguousarray(raw).reshape(-1, 110)  # hmask[32], qs[64], scales[12], d
    n = b.shape[0]
    # the 16 6-bit scales: low 4 bits from bytes 0-7 (nibbles), top 2 bits from bytes 8-11
    sc = b[:, 96:108]
    low = np.concatenate([sc[:, 0:8] & 0x0F, sc[:, 0:8] >> 4], axis=1)  # scales 0-7, 8-15
    high = np.concatenate([(sc[:, 8:12] >> (2 * k)) & 3 for k in range(4)], axis=1)  # 0-3, 4-7, ...
    scales = (low | (high << 4)).astype(np.int16) - 32
    # weight y = 128 h + 32 j + i (h half, j 0-3, i 0-31): qs[32 h + i] bits 2j..2j+1, minus 4
    # unless hmask[i] has bit 4 h + j
    i = np.arange(32)
    q = np.empty((n, 256), np.int16)
    for h in range(2):
        for j in range(4):
            lo2 = (b[:, 32 + 32 * h + i] >> (2 * j)) & 3
            hi = (b[:, i] >> (4 * h + j)) & 1
            q[:, 128 * h + 32 * j + i] = lo2.astype(np.int16) - 4 * (1 - hi.astype(np.int16))
    L = (q + 32).astype(np.uint8)  # Q6_K's stored 6-bit values
    out = np.empty((n, 210), np.uint8)
    for h in range(2):  # Q6_K: per 128 weights 64 bytes of low nibbles, 32 of top bits
        Lh = L[:, 128 * h:128 * h + 128]
        out[:, 64 * h + i] = (Lh[:, i] & 0x0F) | ((Lh[:, 64 + i] & 0x0F) << 4)
        out[:, 64 * h + 32 + i] = (Lh[:, 32 + i] & 0x0F) | ((Lh[:, 96 + i] & 0x0F) << 4)
        out[:, 128 + 32 * h + i] = ((Lh[:, i] >> 4) | ((Lh[:, 32 + i] >> 4) << 2)
                                     | ((Lh[:, 64 + i] >> 4) << 4) | ((Lh[:, 96 + i] >> 4) << 6))
    out[:, 192:208] = scales.astype(np.int8).view(np.uint8)
    out[:, 208:210] = b[:, 108:110]  # the f16 d
    return out.reshape(*lead, row // 110 * 210)
