"""Stream moves between engines: the typed hand-over signal and the parked-stream view.

A stream leaves an engine as a snapshot (snapshot.py) and is imported by another one. Its
consumer on the old engine then gets `StreamMoved` (carrying where it went) instead of an
error or silence, and continues from the new engine's `resume`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvserve.workers.engine.engine import LLMEngine


class StreamMoved(Exception):
    """The request's stream continues on another worker (`target`, an index)."""

    def __init__(self, request_id: str, target: int) -> None:
        super().__init__(f"request {request_id!r} moved to worker {target}")
        self.request_id = request_id
        self.target = target


@dataclass
class MoveCounters:
    """Streams and snapshot bytes that left and arrived, and moves that failed here."""

    moved_out: int = 0
    moved_in: int = 0
    snapshot_bytes_out: int = 0
    snapshot_bytes_in: int = 0
    returned: int = 0  # moves rolled back into this engine after the target failed
    import_failures: int = 0  # snapshots this engine refused

    def as_stats(self) -> dict[str, int]:
        return {f"migration_{k}": v for k, v in self.__dict__.items()}


class ParkedTracker:
    """How long each parked stream has spent parked (the scheduler keeps only their order).

    The time counts every park of the stream on this engine, not just the current one: a
    stream restored and evicted again between the router's polls would otherwise start from
    zero each time, and one that is parked most of the time in short spells would never
    reach the migration threshold. Ages are read at `streams` time, so a long step does not
    make them stale."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}  # parked now: since when (first seen parked)
        self.before: dict[str, float] = {}  # seconds parked in earlier spells (still unfinished)
        self.last = 0.0  # when `view` last looked
        self._view: tuple[float, list[dict[str, Any]]] = (0.0, [])

    def view(self, eng: LLMEngine, now: float | None = None) -> list[dict[str, Any]]:
        """Parked streams, oldest first: id, seconds parked, tokens and KV bytes to move.
        Called on the step thread after each step."""
        now = time.monotonic() if now is None else now
        parked = eng.scheduler.parked
        ids = {s.request_id for s in parked}
        for rid, t in self.since.items():
            if rid not in ids and rid in eng.seqs:  # restored (at the latest when last seen)
                self.before[rid] = self.before.get(rid, 0.0) + max(0.0, self.last - t)
        self.before = {r: t for r, t in self.before.items() if r in eng.seqs}
        self.since = {rid: self.since.get(rid, now) for rid in ids}
        self.last = now
        bpb = eng.runner.cache.bytes_per_block
        out = []
        for s in parked:
            rid = s.request_id
            tokens = s.parked_kv.num_tokens if s.parked_kv is not None else 0
            out.append({"request_id": rid,
                        "parked_s": self.before.get(rid, 0.0) + now - self.since[rid],
                        "tokens": len(s.all_ids),
                        "kv_bytes": eng.kv.blocks_needed(tokens) * bpb,
                        "blocks_needed": eng.kv.blocks_needed(len(s.all_ids) + 1)})
        self._view = (now, out)
        return out

    def streams(self, now: float | None = None) -> list[dict[str, Any]]:
        """The last view with its ages brought up to `now` (any thread)."""
        at, out = self._view
        gone = (time.monotonic() if now is None else now) - at
        return [{**p, "parked_s": p["parked_s"] + gone} for p in out]
