"""The migration planner: which streams move where (pure, no Ray).

Running streams (`plan_rebalance`): a worker under KV pressure (streams parked in its host
tier, or requests waiting, with its device KV at least `pressure_use` full) moves a running
stream live to a worker with room for it and its growth (plus `headroom`), rather than keep
parking: one move per pressured worker at a time, the largest running stream that fits the
roomiest target (it frees the most), never a stream moved in the last `min_interval_s` (so
nothing ping-pongs between two workers).

Parked streams (`plan_moves`):

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
    live: bool = True  # running streams move live (pre-copy); parked ones by snapshot
    rebalance: bool = True  # pressured workers move running streams to workers with room
    pressure_use: float = 0.9  # device KV use from which parking or waiting is pressure
    growth_tokens: int = 256  # room a target keeps for a moved stream's growth
    copy_share: float = 0.02  # of the source's step time a live move's round may copy


@dataclass
class RunningStream:
    request_id: str
    tokens: int
    blocks: int  # device blocks it holds


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
    running: list[RunningStream] = field(default_factory=list)
    block_size: int = 16
    takes_streams: bool = True  # a target for moves (not a prefill worker)


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
            if w.alive and not w.draining and not w.parked and w.waiting == 0
            and w.takes_streams}
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


def pressured(w: WorkerState, cfg: MigrationConfig) -> bool:
    """Parking streams, or requests waiting, with the device KV `pressure_use` full."""
    if not w.alive or w.draining or not (w.parked or w.waiting) or w.kv_blocks_total <= 0:
        return False
    return 1.0 - w.kv_blocks_free / w.kv_blocks_total >= cfg.pressure_use


def plan_rebalance(
    workers: list[WorkerState], cfg: MigrationConfig, moving: set[str],
    last_moved: dict[str, float], now: float, reserved: dict[int, int] | None = None,
) -> list[Move]:
    """Live moves of running streams from pressured workers to workers with room."""
    budget = cfg.max_inflight - len(moving)
    if not (cfg.enabled and cfg.live and cfg.rebalance) or budget <= 0:
        return []
    reserved = reserved or {}
    room = {w.idx: w.kv_blocks_free - int(cfg.headroom * w.kv_blocks_total)
            - reserved.get(w.idx, 0)
            for w in workers
            if w.alive and not w.draining and not w.parked and w.waiting == 0
            and w.takes_streams and not pressured(w, cfg)}
    busy = {m for m in moving}
    moves: list[Move] = []
    for w in sorted((w for w in workers if pressured(w, cfg)),
                    key=lambda w: -(len(w.parked) + w.waiting)):
        if budget <= 0 or not room:
            break
        if any(s.request_id in busy for s in w.running):
            continue  # one move out of a worker at a time
        grow = -(-cfg.growth_tokens // max(1, w.block_size))
        best: tuple[int, int, RunningStream] | None = None
        for s in w.running:
            if s.request_id in busy or now - last_moved.get(s.request_id, float("-inf")) \
                    < cfg.min_interval_s:
                continue
            need = s.blocks + grow
            fits = [(free, idx) for idx, free in room.items() if idx != w.idx and free >= need]
            if fits and (best is None or s.blocks > best[2].blocks):
                best = (max(fits)[1], need, s)
        if best is None:
            continue
        dst, need, s = best
        room[dst] -= need
        moves.append(Move(s.request_id, w.idx, dst, need))
        busy.add(s.request_id)
        budget -= 1
    return moves


def drain_target(workers: list[WorkerState], src: int, load: dict[int, int]) -> int | None:
    """Where a draining worker's stream goes: the live worker with the least load (then the
    most free KV); None when no other worker can take it."""
    ok = [w for w in workers if w.alive and not w.draining and w.idx != src and w.takes_streams]
    if not ok:
        return None
    return min(ok, key=lambda w: (load.get(w.idx, 0), -w.kv_blocks_free)).idx
