"""Attention over per-stream paged KV: the step metadata and backend selection.

A step packs every stream's new tokens into one [T, ...] batch with no padding.
Each stream's queries attend only to that stream's own blocks, so the work per
stream follows its own length, never the longest stream's or the pool's.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvserve.kvcache.device_cache import DeviceKVCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes beyond plain causal softmax(q k^T / sqrt(d)) v."""

    scale: float  # multiplies q k^T (1/sqrt(head_dim) unless the model says otherwise)
    window: int | None = None  # a query at position p sees keys p - window < j <= p
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap)


def plain_layers(num_layers: int, head_dim: int) -> list[LayerAttention]:
    return [LayerAttention(head_dim**-0.5)] * num_layers


def window_start(seq_or_pos: int, window: int | None) -> int:
    """First key a query at position `seq_or_pos` still sees (0 without a window)."""
    return 0 if window is None else max(0, seq_or_pos - window + 1)


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # new tokens per stream in this step
    context_lens: list[int]  # tokens already in the cache before the step
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [T] flat cache slot of every new token
    block_size: int
    prepared: Any = field(default=None)  # backend-specific, built once per step
    # the runner's StepInputs (numpy lengths, rows of the persistent block tables), when it
    # built the step; backends read block tables from there instead of `block_tables`
    inputs: Any = None
    device_tables: torch.Tensor | None = None  # the persistent block tables on the device

    @property
    def num_streams(self) -> int:
        return len(self.query_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens, strict=True)]


class AttentionBackend(Protocol):
    name: str

    def configure(self, layers: list[LayerAttention]) -> None:
        """Each layer's scale, window and soft-cap (once, after the model is built)."""

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        """Build per-step index data once; every layer reuses it."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        cache: DeviceKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write the new K/V into the streams' blocks, then attend."""


def select_backend(
    name: str, device: torch.device, block_size: int, dtype: torch.dtype = torch.float32,
    prefill_rows: bool = False, kv: tuple[torch.dtype, int] | None = None,
) -> AttentionBackend:
    """'torch' always works; 'triton' needs CUDA (or Triton's CPU interpreter) and triton;
    'flash' needs CUDA and vllm-flash-attn; 'auto' on CUDA prefers triton, then flash.
    `prefill_rows`: the torch backend's C kernel attends prompt rows too (TorchAttention).
    `kv`: the KV cache's dtype and head dim (None: the model's dtype)."""
    from kvserve.workers.model.attention_torch import TorchAttention, kernel_reads_kv

    # the C decode kernel covers float32 models on the CPU, over a float32 or float16 cache
    # (whose spans must fit its buffers); everything else stays in torch
    use_kernel = device.type == "cpu" and dtype == torch.float32
    if use_kernel and kv is not None:
        use_kernel = kernel_reads_kv(kv[0], block_size, kv[1])
    if name == "torch":
        return TorchAttention(use_kernel, prefill_rows)
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            return _triton_backend(device)
        except (ImportError, RuntimeError) as e:
            if name == "triton":
                raise RuntimeError(f"attention backend 'triton' unavailable: {e}") from e
            log.info("triton attention not usable (%s)", e)
    if name == "flash" or (name == "auto" and device.type == "cuda"):
        try:
            from kvserve.workers.model.attention_flash import FlashAttention

            return FlashAttention(device, block_size)
        except (ImportError, RuntimeError, ValueError) as e:
            if name == "flash":
                raise RuntimeError(f"attention backend 'flash' unavailable: {e}") from e
            log.info("vllm-flash-attn not usable (%s); using torch attention", e)
    return TorchAttention(use_kernel, prefill_rows)


def _triton_backend(device: torch.device) -> AttentionBackend:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise RuntimeError("triton attention runs on CUDA (on the CPU only with TRITON_INTERPRET=1)")
    from kvserve.workers.model.attention_triton import TritonAttention

    return TritonAttention()
