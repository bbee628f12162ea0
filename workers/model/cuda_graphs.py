"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode-only step of B streams runs as the graph of the smallest bucket >= B. Inputs
go into static buffers sized for the largest bucket; the rows past B are padding: token
0 at position 0, writing its K/V into a scratch block no stream owns, and an empty
attention tile (the kernel stores nothing for it). Graphs are captured once at start-up
(largest bucket first, sharing one memory pool) and need the triton backend, whose
forward has no host synchronisation. `EngineConfig.enforce_eager` turns them off.

On the CPU (tests) the same buffers and padding are used and the "replay" runs the
forward eagerly, so the bucket, padding and buffer logic is checked without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.model.attention import AttentionBackend, AttentionMetadata
from kvserve.workers.model.attention_triton import TritonStep
from kvserve.workers.model.llama import LlamaModel
from kvserve.workers.model.step_inputs import StepInputs, to_device

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_for(max_batch: int) -> list[int]:
    """The buckets up to the first that holds `max_batch` (larger steps run eagerly)."""
    out = []
    for b in BUCKETS:
        out.append(b)
        if b >= max_batch:
            break
    return out


class DecodeGraphs:
    def __init__(self, model: LlamaModel, cache: DeviceKVCache, attn: AttentionBackend,
                 max_batch: int, max_blocks: int, scratch_block: int) -> None:
        self.model, self.cache, self.attn = model, cache, attn
        self.device = cache.kv.device
        self.buckets = buckets_for(max_batch)
        n = self.buckets[-1]
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_block * cache.block_size
        dev, i64 = self.device, torch.int64
        self.ids = torch.zeros(n, dtype=i64, device=dev)
        self.pos = torch.zeros(n, dtype=i64, device=dev)
        self.slots = torch.full((n,), self.scratch_slot, dtype=i64, device=dev)
        self.last = torch.arange(n, dtype=i64, device=dev)
        # tiles: stream i, query row i, 1 token (0 for padding), its position
        self.tiles = torch.stack([self.last, self.last, torch.zeros_like(self.last), self.pos]).contiguous()
        self.tables = torch.zeros(n, max_blocks, dtype=i64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def fits(self, step: StepInputs) -> bool:
        return (self.bucket(len(step.query_lens)) is not None and bool((step.query_lens == 1).all())
                and step.block_tables.shape[1] <= self.max_blocks)

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata([1] * b, [0] * b, [], self.slots[:b], self.cache.block_size,
                                 prepared=TritonStep(self.tables[:b], self.tiles[:, :b], 1))
        return self.model.forward(self.ids[:b], self.pos[:b], meta, self.cache, self.attn, self.last[:b])

    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        """Capture every bucket's graph (CUDA only), largest first, one progress line (and
        one `progress("capturing graphs i/n")`) each."""
        n = len(self.buckets)
        if progress is not None:
            progress(f"capturing graphs 0/{n}")
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture needs
            for b in self.buckets:
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for i, b in enumerate(reversed(self.buckets)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = g
            log.info("CUDA graphs: captured decode batch %d (%d/%d)", b, i + 1, n)
            if progress is not None:
                progress(f"capturing graphs {i + 1}/{n}")
        torch.cuda.synchronize()
        # captures ran the forward on padding only: the scratch block took all the writes

    def load(self, step: StepInputs) -> int:
        """Copy a decode step into the static buffers, padded to its bucket; returns it."""
        n = len(step.query_lens)
        b = self.bucket(n)
        assert b is not None
        pad = b - n
        ids = np.concatenate([step.input_ids, np.zeros(pad, np.int64)])
        pos = np.concatenate([step.positions, np.zeros(pad, np.int64)])
        slots = np.concatenate([step.slot_mapping, np.full(pad, self.scratch_slot, np.int64)])
        lens = np.concatenate([np.ones(n, np.int64), np.zeros(pad, np.int64)])
        w = step.block_tables.shape[1]
        ids_d, pos_d, slots_d, lens_d, tables_d = to_device([ids, pos, slots, lens, step.block_tables],
                                                             self.device)
        self.ids[:b].copy_(ids_d)
        self.pos[:b].copy_(pos_d)
        self.slots[:b].copy_(slots_d)
        self.tiles[2, :b].copy_(lens_d)
        self.tiles[3, :b].copy_(pos_d)
        self.tables[:n, :w].copy_(tables_d)
        return b

    def run(self, step: StepInputs) -> torch.Tensor:
        """Logits [B, vocab] of a decode step (see `fits`), by replay where captured."""
        n = len(step.query_lens)
        b = self.load(step)
        g = self.graphs.get(b)
        if g is None:
            return self._forward(b)[:n]
        g.replay()
        return self.outputs[b][:n]
