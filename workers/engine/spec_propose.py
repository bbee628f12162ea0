"""Proposers for speculative decoding, behind one interface.

A proposer guesses each speculating stream's next tokens; the target model verifies them all
in its next step (`spec_verify.py`). `NgramProposer` looks the stream's last tokens up in its
own prompt and output (prompt lookup decoding); `DraftModelProposer` (`spec_draft.py`) runs a
small model with its own paged KV. A head that drafts from the target's hidden states (EAGLE,
MTP) would implement the same calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from kvserve.workers.engine.sequence import Sequence


class Proposer(Protocol):
    name: str
    # proposals cost next to nothing: made for streams that do not speculate too, so their
    # acceptance is followed without verifying (`SpecPolicy`); a costly proposer (a draft
    # model) is probed instead
    free: bool

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to `ks[i]` tokens that may follow each stream's tokens (fewer, or none, where
        the proposer has no guess)."""
        ...

    def keep_only(self, live: set[str]) -> None:
        """Drop what it holds for streams not in `live` (finished, parked, moved away)."""
        ...

    def step_seconds(self, rows: list[int]) -> float:
        """Its estimated cost of proposing `rows[j]` streams' j+1-th token."""
        ...


def ngram_lookup(ids: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The `k` tokens that followed the latest earlier occurrence of the longest n-gram that
    ends `ids` (n from `hi` down to `lo`) among those followed by k tokens, else the earliest
    (followed by the most); [] when none occurs.

    One vectorised pass finds the earlier positions of the last token; each longer n narrows
    them with one more comparison, so a lookup costs O(len(ids)) once plus O(matches * n)."""
    n_ids = len(ids)
    if k <= 0 or n_ids <= lo:
        return []
    arr = np.fromiter(ids, np.int64, n_ids)
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # earlier occurrences of the last token
    best: np.ndarray | None = ends if lo <= 1 and ends.size else None
    for m in range(1, min(hi, n_ids - 1)):
        ends = ends[ends >= m]
        if not ends.size:
            break
        ends = ends[arr[ends - m] == arr[n_ids - 1 - m]]
        if not ends.size:
            break
        if m + 1 >= lo:
            best = ends  # every match of length m + 1
    if best is None:
        return []
    # the latest match that is followed by k tokens (in a loop of period p the latest match
    # is followed by only p - 1 of them), else the one followed by the most
    full = best[best <= n_ids - 1 - k]
    j = int(full[-1]) if full.size else int(best[0])
    return ids[j + 1 : j + 1 + k]


class NgramProposer:
    name = "ngram"
    free = True

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lo, self.hi = lookup_min, lookup_max

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        lo, hi = self.lo, self.hi
        return [ngram_lookup(s.all_ids, lo, hi, k) for s, k in zip(seqs, ks, strict=True)]

    def keep_only(self, live: set[str]) -> None:
        pass  # it holds nothing per stream

    def step_seconds(self, rows: list[int]) -> float:
        return 0.0
