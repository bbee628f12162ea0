"""Triton attention backend: one kernel launch per layer for the whole mixed step.

The CUDA default when triton imports. `host_plan` turns the step's per-stream lengths
into the kernel's tiles with numpy (no per-token Python); a tile names its stream by the
stream's row in the persistent block-table array, which the kernel reads in place (its
device mirror on CUDA), so no per-step block-table array is built or copied. The runner
sends the tiles with its own step inputs in one copy, and every layer reuses them.
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


def build_tiles(query_lens: np.ndarray, context_lens: np.ndarray, block_q: int,
                rows: np.ndarray | None = None) -> np.ndarray:
    """[4, num_tiles] int64: a stream's query tokens in tiles of at most `block_q`; a tile's
    stream is its row in the block tables (`rows[i]` for stream i, else i)."""
    q = query_lens.astype(np.int64)
    per = -(-q // block_q)
    n = int(per.sum())
    stream = np.repeat(np.arange(len(q)), per)
    first_tile = np.cumsum(per) - per
    off = (np.arange(n) - np.repeat(first_tile, per)) * block_q
    q_start = np.cumsum(q) - q
    out = np.empty((4, n), dtype=np.int64)
    out[0] = stream if rows is None else rows[stream]
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
        """The kernel's integer inputs for this step (the runner copies them with its own):
        the tiles, and a padded block-table array unless the step reads the persistent one."""
        inp = meta.inputs
        if inp is not None:
            qlens, ctxs = inp.query_lens, inp.context_lens
        else:
            qlens = np.asarray(meta.query_lens, dtype=np.int64)
            ctxs = np.asarray(meta.context_lens, dtype=np.int64)
        block_q = 1 if int(qlens.max()) == 1 else PREFILL_TILE
        meta.prepared = block_q
        if inp is not None:
            return [build_tiles(qlens, ctxs, block_q, inp.rows)]
        return [build_tiles(qlens, ctxs, block_q), pad_tables(meta.block_tables, qlens + ctxs, meta.block_size)]

    def bind(self, meta: AttentionMetadata, arrays: list[torch.Tensor]) -> None:
        if len(arrays) == 2:
            tiles, tables = arrays
        else:
            tiles, tables = arrays[0], meta.device_tables
            if tables is None:  # the host array is the device's (CPU, under the interpreter)
                tables = torch.from_numpy(meta.inputs.tables)
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
