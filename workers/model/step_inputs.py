"""A step's model inputs built with numpy from per-stream ranges and the persistent block
tables, sent in one copy.

Token ids, positions, slot mapping and logits rows come from each stream's (start, target)
with array arithmetic, and each stream's blocks are read from its row of the KV manager's
persistent block-table array (`kvcache/block_tables.py`): the Python work per step is
O(streams), never O(tokens) or O(context). On CUDA every integer input of the step (the
attention backend's own arrays and the block-table changes included) travels in one pinned
host buffer and a single host-to-device copy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kvcache.manager import StepPlan


@dataclass
class StepInputs:
    input_ids: np.ndarray  # [T] int64; 0 where the token is still on the device (`runner`)
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] flat cache slot of every new token
    logits_indices: np.ndarray  # [S] last new token of each stream
    query_lens: np.ndarray  # [S]
    context_lens: np.ndarray  # [S]
    rows: np.ndarray  # [S] each stream's row in `tables`
    tables: np.ndarray  # [slots, width] int32: every stream's block table (entries past its length stale)
    num_blocks: int  # the most blocks a stream of this step reads
    # speculative decoding: the rows of T whose logits the step returns (each stream's last,
    # and every proposed position's and the one before them of a stream with proposals),
    # and which streams verify proposals (their query rows attend as decode rows); None
    # when no stream has proposals (the logits rows are `logits_indices`)
    sample_rows: np.ndarray | None = None
    verify: np.ndarray | None = None  # [S] bool

    @property
    def logits_rows(self) -> np.ndarray:
        """The rows of T whose logits the forward returns."""
        return self.logits_indices if self.sample_rows is None else self.sample_rows

    @property
    def block_tables(self) -> np.ndarray:
        """[S, num_blocks] the step's rows, compact (a gather: tests and small consumers)."""
        return self.tables[self.rows, : self.num_blocks]


def build_step(plan: StepPlan, block_size: int, max_model_len: int) -> StepInputs:
    streams = plan.streams
    n = len(streams)
    starts = np.fromiter((p.start for p in streams), np.int64, n)
    if plan.num_tokens == n:  # decode only (a plan from the manager says so)
        targets = starts + 1
    else:
        targets = np.fromiter((p.target for p in streams), np.int64, n)
    top = int(targets.max())
    if top > max_model_len:
        p = streams[int(np.flatnonzero(targets > max_model_len)[0])]
        raise ValueError(f"stream {p.stream_id}: {p.target} tokens exceed max_model_len {max_model_len}")
    qlens = targets - starts
    total = int(qlens.sum())
    token_ids = plan.token_ids
    if total == n:  # decode only: one token per stream (past the known ones: on the device)
        ids = np.fromiter((t[s] if s < len(t) else 0 for t, s in
                           zip([token_ids[p.stream_id] for p in streams], starts.tolist(), strict=True)),
                          np.int64, n)
        positions = starts
    else:
        ids = np.fromiter(
            itertools.chain.from_iterable(_chunk(token_ids[p.stream_id], p.start, p.target) for p in streams),
            np.int64, total,
        )
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(qlens) - qlens), qlens)
    ends = np.cumsum(qlens)
    if plan.tables is not None:
        tables = plan.tables.array
        rows = np.fromiter((p.slot for p in streams), np.int64, n)
    else:  # a plan made by hand (tests): rows from the streams' block lists
        tables, rows = _tables_from_lists([p.block_ids for p in streams]), np.arange(n)
    owner = rows if total == n else np.repeat(rows, qlens)
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    step = StepInputs(ids, positions, slots, ends - 1, qlens, starts, rows, tables,
                      -(-top // block_size))
    if plan.num_drafts:
        drafts = np.fromiter((p.drafts for p in streams), np.int64, n)
        counts = drafts + 1  # a stream with d proposals: logits of its last d + 1 positions
        first = np.repeat(ends - counts, counts)
        step.sample_rows = first + (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
        step.verify = drafts > 0
    return step


def _chunk(tokens: list[int], start: int, target: int) -> list[int]:
    """tokens[start:target]; a position past the known tokens (its token is on the device,
    one per stream at most) reads as 0."""
    part = tokens[start:target]
    return part if len(part) == target - start else part + [0] * (target - start - len(part))


def _tables_from_lists(block_ids: list[list[int]]) -> np.ndarray:
    lens = np.fromiter((len(b) for b in block_ids), np.int64, len(block_ids))
    out = np.zeros((len(block_ids), max(1, int(lens.max()))), dtype=np.int32)
    out[np.arange(out.shape[1]) < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_ids), np.int32, int(lens.sum()))
    return out


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
