"""Every running stream's block table as a row of one persistent [slots, width] array.

A stream takes a row (its batch slot) when it joins the batch and gives it back when it
leaves. A step writes only the entries of the blocks it took, so keeping the tables costs
O(new blocks) per step, never O(context): a decode step that fills no block writes nothing.
Step inputs read the rows they need straight from the array (on CUDA its device mirror,
which receives only the changed entries; see `take_updates`).

Entries past a stream's length are stale (a rolled-back step's blocks, a previous owner's
row) and never read: a stream's attention stops at its own length.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch


class BlockTables:
    def __init__(self, width: int, slots: int = 16, pin: bool = False) -> None:
        if width < 1 or slots < 1:
            raise ValueError("block tables need width >= 1 and slots >= 1")
        self.width = width
        self.pin = pin
        self.array = self._alloc(slots)
        self._free = list(range(slots))  # a heap: the lowest free slot goes first
        self.capacity_changes = 0  # a device mirror sized for the old capacity is stale
        # (slot, first column, count) written since the last take_updates; kept only when a
        # device mirror reads them (`track`), else the array itself is what steps read
        self.track = False
        self._updates: list[tuple[int, int, int]] = []

    def _alloc(self, slots: int) -> np.ndarray:
        # pinned on CUDA, so a mirror can copy from it without staging
        return torch.zeros((slots, self.width), dtype=torch.int32, pin_memory=self.pin).numpy()

    @property
    def slots(self) -> int:
        return self.array.shape[0]

    def add(self, blocks: list[int]) -> int:
        """Give a joining stream a row holding `blocks`; returns its slot."""
        if not self._free:
            self._grow()
        slot = heapq.heappop(self._free)
        self.write(slot, 0, blocks)
        return slot

    def write(self, slot: int, first: int, blocks: list[int]) -> None:
        """Store `blocks` at columns first.. of `slot` (a stream that gained blocks)."""
        n = len(blocks)
        if n:
            self.array[slot, first : first + n] = blocks
            if self.track:
                self._updates.append((slot, first, n))

    def remove(self, slot: int) -> None:
        """A stream left the batch: its row is free for the next one."""
        heapq.heappush(self._free, slot)

    def _grow(self) -> None:
        old = self.array
        self.array = self._alloc(2 * old.shape[0])
        self.array[: old.shape[0]] = old
        for s in range(old.shape[0], self.array.shape[0]):
            heapq.heappush(self._free, s)
        self.capacity_changes += 1

    def take_updates(self) -> tuple[np.ndarray, np.ndarray]:
        """(flat indices, values) of the entries written since the last call, for a device
        mirror to apply with one scatter; the values are read now, so a row written twice
        sends its latest content."""
        ups, self._updates = self._updates, []
        if not ups:
            empty = np.zeros(0, np.int64)
            return empty, empty
        w = self.width
        counts = np.fromiter((n for _, _, n in ups), np.int64, len(ups))
        starts = np.fromiter((s * w + c for s, c, _ in ups), np.int64, len(ups))
        # flat index runs: start of each run repeated, plus the offset within the run
        idx = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
        return idx, self.array.ravel()[idx].astype(np.int64)

    def free_slots(self) -> list[int]:
        return sorted(self._free)
