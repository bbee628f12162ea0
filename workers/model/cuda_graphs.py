"""Steps replayed from CUDA graphs: decode steps by batch size, steps that carry prompt
tokens by (token count, stream count), steps that verify speculative proposals by token count.

A decode-only step of B streams runs as the graph of the smallest decode bucket >= B. A
step with prompt tokens (chunked prefill, a restored or recomputed stream, a new arrival
beside running streams) of T tokens over S streams runs as the graph of the smallest
mixed bucket (T', S') with T' >= T and S' >= S; its attention is the one-launch Triton
kernel with 16-token tiles, as eagerly. A step verifying proposals (logits for each
proposed position and the one before, more rows than streams) of T tokens runs as the graph
of the smallest verify bucket >= T, whose logits rows are as many as its tokens. Steps
larger than every bucket run eagerly.

Inputs go into one static buffer, laid out per bucket as tiles (stream row, first query
row, tokens, position), token ids, positions, cache slots and logits rows. The rows past
the real ones are padding: token 0 at position 0 writing its K/V into a scratch block no
stream owns, tiles with no tokens (the kernel stores nothing for them), logits row 0
(dropped). Tiles name streams by their rows in the persistent block-table array, whose
device mirror the graphs read in place; the step's changed table entries and, under
asynchronous scheduling, the token ids still on the device follow the bucket's inputs in
the same host-to-device copy and are applied by two small scatters before the replay.
Graphs are captured once at start-up (largest first, sharing one memory pool) and need
the triton backend, whose forward has no host synchronisation. `EngineConfig.enforce_eager`
turns them off.

On the CPU (tests) the same buffers and padding are used and the "replay" runs the
forward eagerly, so the bucket, padding and buffer logic is checked without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.model.attention import AttentionBackend, AttentionMetadata
from kvserve.workers.model.attention_triton import PREFILL_TILE, TritonStep, build_tiles
from kvserve.workers.model.layers.decoder import DecoderModel
from kvserve.workers.model.step_inputs import StepInputs

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode: streams
MIXED_TOKENS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)  # about 1.5x apart
MIXED_STREAMS = (4, 16, 64, 256)
VERIFY_TOKENS = (8, 16, 32, 64, 128, 256, 512)  # verify steps: tokens, each a logits row


def buckets_for(max_batch: int) -> list[int]:
    """The decode buckets up to the first that holds `max_batch` (larger steps run eagerly)."""
    out = []
    for b in BUCKETS:
        out.append(b)
        if b >= max_batch:
            break
    return out


def _upto(values: tuple[int, ...], limit: int) -> list[int]:
    """The values up to the first >= limit."""
    out = []
    for v in values:
        out.append(v)
        if v >= limit:
            break
    return out


@dataclass(frozen=True)
class GraphKey:
    tokens: int
    streams: int
    block_q: int  # 1: decode tiles; PREFILL_TILE: a step with prompt tokens
    rows: int = 0  # logits rows (0: one per stream; a verify bucket: one per token)

    @property
    def logits_rows(self) -> int:
        return self.rows or self.streams

    @property
    def tiles(self) -> int:
        """Tiles the bucket holds: any step of <= `tokens` tokens over <= `streams` streams
        fits (a stream of q tokens takes 1 + (q - 1) // block_q tiles)."""
        if self.block_q == 1:
            return self.tokens
        return min(self.tokens, self.streams + self.tokens // self.block_q)

    @property
    def size(self) -> int:
        return 4 * self.tiles + 3 * self.tokens + self.logits_rows

    @property
    def kind(self) -> str:
        return "decode" if self.block_q == 1 else "verify" if self.rows else "mixed"


def mixed_keys(max_tokens: int, max_streams: int) -> list[GraphKey]:
    """Mixed buckets: token counts up to the first that holds `max_tokens` (at most 2048),
    each with the stream buckets up to the first that holds min(its tokens, max_streams)."""
    keys = []
    for t in _upto(MIXED_TOKENS, max_tokens):
        for s in _upto(MIXED_STREAMS, min(t, max_streams)):
            keys.append(GraphKey(t, min(s, max(max_streams, 1)), PREFILL_TILE))
    return sorted(set(keys), key=lambda k: (k.tokens, k.streams))


def verify_keys(max_tokens: int) -> list[GraphKey]:
    """Verify buckets: token counts up to the first that holds `max_tokens` (at most 512),
    each as many streams (tiles) and logits rows as tokens, so any verify step fits."""
    return [GraphKey(t, t, PREFILL_TILE, rows=t) for t in _upto(VERIFY_TOKENS, max_tokens)]


class StepGraphs:
    def __init__(self, model: DecoderModel, cache: DeviceKVCache, attn: AttentionBackend,
                 max_batch: int, tables: torch.Tensor, scratch_block: int,
                 max_tokens: int = 0, extra: int = 0, verify_tokens: int = 0) -> None:
        """`tables`: the device mirror of the persistent block tables the graphs read;
        `max_tokens`: the step token budget (0: decode graphs only); `extra`: room for a
        step's table changes and device token ids after its inputs; `verify_tokens`: the
        most tokens of a step verifying proposals (0: no verify graphs)."""
        self.model, self.cache, self.attn = model, cache, attn
        self.device = cache.kv.device
        self.buckets = buckets_for(max_batch)
        self.decode = {b: GraphKey(b, b, 1) for b in self.buckets}
        self.mixed = mixed_keys(max_tokens, max_batch) if max_tokens > 0 else []
        self.verify = verify_keys(verify_tokens) if verify_tokens > 0 else []
        self.tables = tables
        self.scratch_slot = scratch_block * cache.block_size
        keys = [*self.decode.values(), *self.mixed, *self.verify]
        self.static = max(k.size for k in keys)
        size = self.static + extra
        dev, i64, pin = self.device, torch.int64, self.device.type == "cuda"
        # two pinned staging buffers, used in turn: a step is staged while the copy of the
        # one before may still be queued behind the running step (asynchronous scheduling)
        self.host = [torch.zeros(size, dtype=i64, pin_memory=pin) for _ in range(2)]
        self._events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._turn = 0
        self.inputs = torch.zeros(size, dtype=i64, device=dev)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}

    @property
    def keys(self) -> list[GraphKey]:
        return [*self.decode.values(), *self.mixed, *self.verify]

    def views(self, key: GraphKey) -> dict[str, torch.Tensor]:
        """The bucket's static inputs: views of the one input buffer."""
        x, c, t = self.inputs, key.tiles, key.tokens
        return {"tiles": x[: 4 * c].view(4, c), "ids": x[4 * c : 4 * c + t],
                "pos": x[4 * c + t : 4 * c + 2 * t], "slots": x[4 * c + 2 * t : 4 * c + 3 * t],
                "last": x[4 * c + 3 * t : key.size]}

    def key_for(self, step: StepInputs, extra: int = 0) -> GraphKey | None:
        """The bucket that runs `step` (None: eagerly); `extra` inputs must fit after it."""
        n, total = len(step.query_lens), len(step.input_ids)
        if extra > self.inputs.numel() - self.static:
            return None
        if step.sample_rows is not None:  # verifying proposals: a logits row per position
            # (a verify bucket's tiles and logits rows are its tokens: the step's fit too)
            return next((key for key in self.verify if key.tokens >= total), None)
        if total == n:
            for b, key in self.decode.items():
                if b >= n:
                    return key
            return None
        for key in self.mixed:
            if key.tokens >= total and key.streams >= n:
                return key
        return None

    def _forward(self, key: GraphKey) -> torch.Tensor:
        v = self.views(key)
        s = key.streams
        meta = AttentionMetadata([1] * s, [0] * s, [], v["slots"], self.cache.block_size,
                                 prepared=TritonStep(self.tables, v["tiles"], key.block_q))
        return self.model.forward(v["ids"], v["pos"], meta, self.cache, self.attn, v["last"])

    def stage(self, key: GraphKey, step: StepInputs | None, extras: list[np.ndarray]) -> list[torch.Tensor]:
        """Write the bucket's inputs (padded) and `extras` after them, copy them over in one
        copy; returns the extras' device views."""
        i = self._turn
        self._turn ^= 1
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()  # the copy that last read this staging buffer has run
        h = self.host[i].numpy()
        c, t = key.tiles, key.tokens
        tiles = h[: 4 * c].reshape(4, c)
        tiles[0] = 0  # padding tiles: no tokens, so nothing is read or stored
        tiles[1] = np.arange(c)
        tiles[2:] = 0
        ids, pos, slots, last = (h[4 * c : 4 * c + t], h[4 * c + t : 4 * c + 2 * t],
                                 h[4 * c + 2 * t : 4 * c + 3 * t], h[4 * c + 3 * t : key.size])
        ids[:] = 0
        pos[:] = 0
        slots[:] = self.scratch_slot
        last[:] = 0
        if step is not None:
            real = build_tiles(step.query_lens, step.context_lens, key.block_q, step.rows)
            tiles[:, : real.shape[1]] = real
            n = len(step.input_ids)
            ids[:n] = step.input_ids
            pos[:n] = step.positions
            slots[:n] = step.slot_mapping
            rows = step.logits_rows
            last[: len(rows)] = rows
        at = key.size
        spans = []
        for a in extras:
            h[at : at + a.size] = a
            spans.append((at, a.size))
            at += a.size
        self.inputs[:at].copy_(self.host[i][:at], non_blocking=True)
        if ev is not None:
            ev.record()
        return [self.inputs[a : a + n] for a, n in spans]

    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        """Capture every bucket's graph (CUDA only), largest first, one log line (and one
        `progress("capturing graphs i/n")`) each."""
        keys = sorted(self.keys, key=lambda k: (k.size, k.block_q), reverse=True)
        n = len(keys)
        if progress is not None:
            progress(f"capturing graphs 0/{n}")
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture needs
            for key in keys:
                self.stage(key, None, [])
                self._forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for i, key in enumerate(keys):
            self.stage(key, None, [])  # padding only
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[key] = self._forward(key)
            self.graphs[key] = g
            log.info("CUDA graphs: captured %s %d tokens / %d streams (%d/%d)", key.kind,
                     key.tokens, key.streams, i + 1, n)
            if progress is not None:
                progress(f"capturing graphs {i + 1}/{n}")
        torch.cuda.synchronize()
        # captures ran the forward on padding only: the scratch block took all the writes

    def run(self, step: StepInputs, key: GraphKey) -> torch.Tensor:
        """Logits [R, vocab] of a step staged for `key` (R: its logits rows, one per stream
        unless it verifies proposals), by replay where captured."""
        n = len(step.logits_rows)
        g = self.graphs.get(key)
        if g is None:
            return self._forward(key)[:n]
        g.replay()
        return self.outputs[key][:n]
