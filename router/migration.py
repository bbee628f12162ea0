"""The migration planner: which parked streams move where (pure, no Ray).

A worker whose device KV is full parks streams in its host tier until it has room again.
When a stream has spent longer than `park_threshold_s` parked (in all, across its
evictions: see workers/engine/migration.py) and another worker has room for it (its KV
plus `headroom` of that worker's pool left free, no parked streams of its own), the oldest
such streams move there. A target's room is what its last poll showed less the blocks of
moves already headed there that the poll did not see yet. Bounded: at most `max_inflight`
moves at once, and a stream moves at most once per `min_interval_s` (counted from the end of
its last move, failed ones included).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MigrationConfig:
    enabled: bool = True
    park_threshold_s: float = 1.0
    max_inflight: int = 4
    min_interval_s: float = 5.0
    headroom: float = 0.1  # share of the target's device pool left free after the move
    import_timeout_s: float = 30.0


@dataclass
class ParkedStream:
    request_id: str
    parked_s: float
    blocks_needed: int  # device blocks it takes once restored
    kv_bytes: int = 0


@dataclass
class WorkerState:
    idx: int
    alive: bool = True
    draining: bool = False
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    parked: list[ParkedStream] = field(default_factory=list)  # oldest first


@dataclass(frozen=True)
class Move:
    request_id: str
    src: int
    dst: int
    blocks: int = 0  # device blocks it takes on `dst`


def plan_moves(
    workers: list[WorkerState], cfg: MigrationConfig, moving: set[str],
    last_moved: dict[str, float], now: float, reserved: dict[int, int] | None = None,
) -> list[Move]:
    """Moves to start now, oldest parked streams first. `reserved`: device blocks per
    worker that moves on their way there will take (not in its last poll yet)."""
    budget = cfg.max_inflight - len(moving)
    if not cfg.enabled or budget <= 0:
        return []
    reserved = reserved or {}
    room = {w.idx: w.kv_blocks_free - int(cfg.headroom * w.kv_blocks_total)
            - reserved.get(w.idx, 0)
            for w in workers
            if w.alive and not w.draining and not w.parked and w.waiting == 0}
    candidates = sorted(
        ((s.parked_s, s, w.idx) for w in workers if w.alive for s in w.parked),
        key=lambda c: -c[0],
    )
    moves: list[Move] = []
    for parked_s, s, src in candidates:
        if budget <= 0:
            break
        if parked_s < cfg.park_threshold_s or s.request_id in moving:
            continue
        if now - last_moved.get(s.request_id, float("-inf")) < cfg.min_interval_s:
            continue
        fits = [(free, idx) for idx, free in room.items()
                if idx != src and free >= s.blocks_needed]
        if not fits:
            continue
        _, dst = max(fits)
        room[dst] -= s.blocks_needed
        moves.append(Move(s.request_id, src, dst, s.blocks_needed))
        budget -= 1
    return moves


def drain_target(workers: list[WorkerState], src: int, load: dict[int, int]) -> int | None:
    """Where a draining worker's stream goes: the live worker with the least load (then the
    most free KV); None when no other worker can take it."""
    ok = [w for w in workers if w.alive and not w.draining and w.idx != src]
    if not ok:
        return None
    return min(ok, key=lambda w: (load.get(w.idx, 0), -w.kv_blocks_free)).idx
