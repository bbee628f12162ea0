"""A step's model inputs built with numpy from per-stream ranges, sent in one copy.

Token ids, positions, slot mapping, logits rows and the padded block-table array come
from each stream's (start, target) and block table with array arithmetic: the Python
work per step is O(streams), never O(tokens). On CUDA every integer input of the step
(the attention backend's own arrays included) travels in one pinned host buffer and a
single host-to-device copy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kvcache.manager import StepPlan


@dataclass
class StepInputs:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] flat cache slot of every new token
    logits_indices: np.ndarray  # [S] last new token of each stream
    query_lens: np.ndarray  # [S]
    context_lens: np.ndarray  # [S]
    block_tables: np.ndarray  # [S, max_blocks] (zero-padded)


def build_step(plan: StepPlan, block_size: int, max_model_len: int) -> StepInputs:
    streams = plan.streams
    n = len(streams)
    starts = np.fromiter((p.start for p in streams), np.int64, n)
    targets = np.fromiter((p.target for p in streams), np.int64, n)
    over = np.flatnonzero(targets > max_model_len)
    if over.size:
        p = streams[int(over[0])]
        raise ValueError(f"stream {p.stream_id}: {p.target} tokens exceed max_model_len {max_model_len}")
    qlens = targets - starts
    total = int(qlens.sum())
    token_ids = plan.token_ids
    if total == n:  # decode only: one token per stream
        ids = np.fromiter((token_ids[p.stream_id][p.start] for p in streams), np.int64, n)
        positions = starts.copy()
    else:
        ids = np.fromiter(
            itertools.chain.from_iterable(token_ids[p.stream_id][p.start : p.target] for p in streams),
            np.int64, total,
        )
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(qlens) - qlens), qlens)
    ends = np.cumsum(qlens)
    # the padded block tables from one flat list: row-major order of the mask is table order
    lens = np.fromiter((len(p.block_ids) for p in streams), np.int64, n)
    width = int(lens.max())
    tables = np.zeros((n, width), dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(p.block_ids for p in streams), np.int64,
                       int(lens.sum()))
    tables[np.arange(width) < lens[:, None]] = flat
    owner = np.repeat(np.arange(n), qlens) if total != n else np.arange(n)
    slots = tables[owner, positions // block_size] * block_size + positions % block_size
    return StepInputs(ids, positions, slots, ends - 1, qlens, starts, tables)


def to_device(parts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors on `device` for each array; on CUDA through one pinned buffer and
    one non-blocking copy."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in parts]
    sizes = [a.size for a in parts]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    flat = host.numpy()
    at = 0
    for a, n in zip(parts, sizes, strict=True):
        flat[at : at + n] = a.ravel()
        at += n
    buf = host.to(device, non_blocking=True)
    out, at = [], 0
    for a, n in zip(parts, sizes, strict=True):
        out.append(buf[at : at + n].view(a.shape))
        at += n
    return out
