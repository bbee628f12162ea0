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
from kvserve.workers.model.layers.decoder import DecoderModel
from kvserve.workers.model.step_inputs import StepInputs

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
    def __init__(self, model: DecoderModel, cache: DeviceKVCache, attn: AttentionBackend,
                 max_batch: int, max_blocks: int, scratch_block: int) -> None:
        self.model, self.cache, self.attn = model, cache, attn
        self.device = cache.kv.device
        self.buckets = buckets_for(max_batch)
        n = self.buckets[-1]
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_block * cache.block_size
        dev, i64 = self.device, torch.int64
        # A step's inputs for bucket b sit at the front of one buffer, six rows of b:
        # tiles (stream, first query row, tokens, position), token ids, cache slots, then
        # the step's block-table rows. One host-to-device copy fills it from pinned memory.
        size = 6 * n + n * max_blocks
        self.host = torch.zeros(size, dtype=i64, pin_memory=dev.type == "cuda")
        self.host_np = self.host.numpy()
        self.inputs = torch.zeros(size, dtype=i64, device=dev)
        self.last = torch.arange(n, dtype=i64, device=dev)
        self.tables = torch.zeros(n, max_blocks, dtype=i64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None

    def views(self, b: int) -> dict[str, torch.Tensor]:
        """Bucket b's static inputs: views of the one input buffer."""
        x = self.inputs
        return {"tiles": x[: 4 * b].view(4, b), "pos": x[3 * b : 4 * b], "ids": x[4 * b : 5 * b],
                "slots": x[5 * b : 6 * b]}

    def bucket(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def fits(self, step: StepInputs) -> bool:
        return (self.bucket(len(step.query_lens)) is not None and bool((step.query_lens == 1).all())
                and step.block_tables.shape[1] <= self.max_blocks)

    def _forward(self, b: int) -> torch.Tensor:
        v = self.views(b)
        meta = AttentionMetadata([1] * b, [0] * b, [], v["slots"], self.cache.block_size,
                                 prepared=TritonStep(self.tables[:b], v["tiles"], 1))
        return self.model.forward(v["ids"], v["pos"], meta, self.cache, self.attn, self.last[:b])

    def _stage(self, b: int, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray,
               tables: np.ndarray) -> None:
        """Write bucket b's inputs (n real rows, the rest padding) and copy them over."""
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has left the pinned buffer
        n, w = tables.shape
        h = self.host_np
        h[: 2 * b] = np.tile(np.arange(b), 2)  # stream i, query row i
        h[2 * b : 2 * b + n] = 1  # one token per real row; padding rows have none
        h[2 * b + n : 3 * b] = 0
        for k, (real, pad) in enumerate(((pos, 0), (ids, 0), (slots, self.scratch_slot)), start=3):
            h[k * b : k * b + n] = real
            h[k * b + n : (k + 1) * b] = pad
        end = 6 * b + n * w
        h[6 * b : end] = tables.ravel()
        self.inputs[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if n:
            self.tables[:n, :w].copy_(self.inputs[6 * b : end].view(n, w))

    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        """Capture every bucket's graph (CUDA only), largest first, one progress line (and
        one `progress("capturing graphs i/n")`) each."""
        n = len(self.buckets)
        if progress is not None:
            progress(f"capturing graphs 0/{n}")
        empty = np.zeros(0, np.int64)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture needs
            for b in self.buckets:
                self._stage(b, empty, empty, empty, np.zeros((0, 1), np.int64))
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for i, b in enumerate(reversed(self.buckets)):
            self._stage(b, empty, empty, empty, np.zeros((0, 1), np.int64))  # padding only
            torch.cuda.synchronize()
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
        b = self.bucket(len(step.query_lens))
        assert b is not None
        self._stage(b, step.input_ids, step.positions, step.slot_mapping, step.block_tables)
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
