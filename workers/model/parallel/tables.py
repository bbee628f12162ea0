"""The persistent block tables on every rank of a tensor-parallel engine.

Rank 0's KV manager owns the tables (`kvcache/block_tables.py`). With each step it sends
the entries written since the last one (`TableSync.take`; the whole array when it grew),
and every rank keeps a `TableMirror` of them: its steps read their rows there, as rank 0's
read the manager's, and on CUDA its device copy takes the same changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvserve.kvcache.block_tables import BlockTables

_EMPTY = np.zeros(0, np.int64)


@dataclass
class TableDelta:
    capacity: int  # the tables' growth count when taken
    full: np.ndarray | None  # the whole array, when it grew since the last delta
    idx: np.ndarray  # flat indices written since the last delta
    vals: np.ndarray


class TableMirror:
    """Another rank's copy of the block tables (what `DeviceTables` and step inputs read)."""

    def __init__(self, array: np.ndarray, copy: bool = True) -> None:
        self.copy = copy
        self.array = array.copy() if copy else array
        self.capacity_changes = 0
        self.track = False  # set by DeviceTables; updates are kept either way
        self._pending: tuple[np.ndarray, np.ndarray] = (_EMPTY, _EMPTY)

    def apply(self, delta: TableDelta) -> None:
        if delta.full is not None:
            self.array = delta.full.copy() if self.copy else delta.full
            self.capacity_changes = delta.capacity
        elif delta.idx.size:
            self.array.ravel()[delta.idx] = delta.vals
        self._pending = (delta.idx, delta.vals)

    def take_updates(self) -> tuple[np.ndarray, np.ndarray]:
        out, self._pending = self._pending, (_EMPTY, _EMPTY)
        return out


class TableSync:
    """Rank 0's side: the deltas of its KV manager's tables, and its own mirror of them (an
    alias of the manager's array) for its device copy."""

    def __init__(self, tables: BlockTables) -> None:
        self.tables = tables
        tables.track = True
        self.sent = -1  # the first delta carries the whole array
        self.mirror = TableMirror(tables.array, copy=False)

    def take(self) -> TableDelta:
        t = self.tables
        full = None
        if t.capacity_changes != self.sent:
            self.sent = t.capacity_changes
            full = t.array
        idx, vals = t.take_updates()
        delta = TableDelta(t.capacity_changes, full, idx, vals)
        self.mirror.apply(delta)
        return delta


class TableRows(Sequence):
    """Each stream's block ids up to its length, read from the mirror when asked (the
    attention backends' per-stream view; decode steps read the array's rows instead)."""

    def __init__(self, array: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
                 block_size: int) -> None:
        self.array, self.rows = array, rows
        self.blocks = -(-lengths // block_size)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.array[self.rows[i], : self.blocks[i]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[i] for i in range(len(self)))
