"""Triton attention backend: one kernel launch per layer for the whole mixed step.

The CUDA default when triton imports. `prepare` turns the step's per-stream lengths
into the kernel's tiles and a padded block-table array with numpy (no per-token
Python); the runner sends them to the device with its own step inputs in one copy, and
every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.model.attention import AttentionMetadata, LayerAttention
from kvserve.workers.model.step_inputs import to_device
from kvserve.workers.model.triton_paged_attention import paged_attention

PREFILL_TILE = 16  # query tokens per tile when a step has prefill chunks


@dataclass
class TritonStep:
    tables: torch.Tensor  # [S, max_blocks] int64
    tiles: torch.Tensor  # [4, num_tiles] int64: stream, first q row, tokens, position
    block_q: int


def build_tiles(query_lens: np.ndarray, context_lens: np.ndarray, block_q: int) -> np.ndarray:
    """[4, num_tiles] int64: a stream's query tokens in tiles of at most `block_q`."""
    q = query_lens.astype(np.int64)
    per = -(-q // block_q)
    n = int(per.sum())
    stream = np.repeat(np.arange(len(q)), per)
    first_tile = np.cumsum(per) - per
    off = (np.arange(n) - np.repeat(first_tile, per)) * block_q
    q_start = np.cumsum(q) - q
    out = np.empty((4, n), dtype=np.int64)
    out[0] = stream
    out[1] = np.repeat(q_start, per) + off
    out[2] = np.minimum(block_q, np.repeat(q, per) - off)
    out[3] = np.repeat(context_lens.astype(np.int64), per) + off
    return out


def pad_tables(tables: list[list[int]], seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """[S, max_blocks] int64 of the blocks each stream's KV uses (zero-padded)."""
    used = -(-seq_lens // block_size)
    width = max(1, int(used.max()) if len(used) else 1)
    out = np.zeros((len(tables), width), dtype=np.int64)
    for i, t in enumerate(tables):  # one row copy per stream, not per token
        n = int(used[i])
        out[i, :n] = t[:n]
    return out


class TritonAttention:
    name = "triton"

    def __init__(self) -> None:
        self.layers: list[LayerAttention] | None = None  # None: plain attention everywhere

    def configure(self, layers: list[LayerAttention]) -> None:
        self.layers = layers

    def host_plan(self, meta: AttentionMetadata) -> list[np.ndarray]:
        """The kernel's integer inputs for this step (the runner copies them with its own)."""
        qlens = np.asarray(meta.query_lens, dtype=np.int64)
        ctxs = np.asarray(meta.context_lens, dtype=np.int64)
        block_q = 1 if int(qlens.max()) == 1 else PREFILL_TILE
        tables = meta.block_table_array
        if tables is None:
            tables = pad_tables(meta.block_tables, qlens + ctxs, meta.block_size)
        meta.prepared = block_q
        return [build_tiles(qlens, ctxs, block_q), tables]

    def bind(self, meta: AttentionMetadata, arrays: list[torch.Tensor]) -> None:
        tiles, tables = arrays
        meta.prepared = TritonStep(tables, tiles, meta.prepared)

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        self.bind(meta, to_device(self.host_plan(meta), device))

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: DeviceKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cache.write(layer, meta.slot_mapping, k, v)
        return self.attend(layer, q, cache, meta)

    def attend(self, layer: int, q: torch.Tensor, cache: DeviceKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention only: the step's K/V are already in the cache (the fused RoPE kernel
        stored them)."""
        kc, vc = cache.layer(layer)
        p: TritonStep = meta.prepared
        if self.layers is None:
            return paged_attention(q, kc, vc, p.tables, p.tiles, p.block_q)
        spec = self.layers[layer]
        return paged_attention(q, kc, vc, p.tables, p.tiles, p.block_q, scale=spec.scale,
                               window=spec.window, softcap=spec.softcap)
