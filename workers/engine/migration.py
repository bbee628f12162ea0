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
    """When each parked stream was parked (the scheduler keeps only their order)."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}

    def view(self, eng: LLMEngine) -> list[dict[str, Any]]:
        """Parked streams, oldest first: id, seconds parked, tokens and KV bytes to move."""
        now = time.monotonic()
        since = {s.request_id: self.since.get(s.request_id, now) for s in eng.scheduler.parked}
        self.since = since
        bpb = eng.runner.cache.bytes_per_block
        out = []
        for s in eng.scheduler.parked:
            tokens = s.parked_kv.num_tokens if s.parked_kv is not None else 0
            out.append({"request_id": s.request_id, "parked_s": now - since[s.request_id],
                        "tokens": len(s.all_ids),
                        "kv_bytes": eng.kv.blocks_needed(tokens) * bpb,
                        "blocks_needed": eng.kv.blocks_needed(len(s.all_ids) + 1)})
        return out
