"""Disaggregated serving: prefill on one worker, decode on another (the router's side).

Workers have roles (`mixed`, today's default, or `prefill` / `decode`). With prefill and
decode workers, each request is routed in two parts:

- a **decode worker** by room (its device KV, less what hand-offs on their way there take,
  holds the prompt and its growth), session (a session's next turn goes to the decode
  worker holding its KV, within the imbalance bound), then load (requests in flight and
  hand-offs on their way);
- **local prefill** on that decode worker when the prompt is shorter than
  `min_prompt_tokens`, when most of it (`local_prefix_share`) is a prefix hit there, when no
  prefill worker is available, or when no decode worker has room (the request then waits in
  that worker's queue as on a mixed worker);
- otherwise a **prefill worker** by the routing policy among the prefill workers (KV
  affinity, then load), and the decode worker **reserves** room for the stream before the
  prompt starts (router/handoff.py); the request starts on the prefill worker, which sends
  the first token to the client and holds the stream; the router then hands it over
  (`hand_off`) and the client's stream continues on the decode worker
  (deploy/stream_relay.py follows it).

Workers whose KV cannot be exchanged (another model geometry, KV dtype or block size) are
refused at start (`check_exchange`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from kvserve.router.handoff import HandoffConfig, HandoffResult, hand_off, reservation, reserve
from kvserve.router.live_move import MoveFailed, RayWorker
from kvserve.router.policy import Policy, RouteRequest, WorkerView

log = logging.getLogger(__name__)

ROLES = ("mixed", "prefill", "decode")
# why a request of a disaggregated deployment was prefilled where it decodes
LOCAL_REASONS = ("short_prompt", "prefix_hit", "no_room", "no_prefill_worker",
                 "no_decode_worker")
HANDOFF_LOG = 2000  # recent hand-offs kept for `handoff_log` (benches)


@dataclass
class DisaggConfig:
    min_prompt_tokens: int = 16  # shorter prompts are prefilled where they decode
    local_prefix_share: float = 0.5  # ... and those this share of which is cached there
    failure_policy: str = "recompute"  # a failed hand-off: recompute on decode, or fail
    lease_s: float = 60.0  # reservations and held streams untouched this long are freed
    growth_tokens: int = 256  # the decode worker reserves this much beyond the prompt

    def __post_init__(self) -> None:
        from kvserve.router.handoff import FAILURE_POLICIES

        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"disagg failure policy {self.failure_policy!r} is not one of "
                             f"{', '.join(FAILURE_POLICIES)}")


def check_roles(roles: list[str]) -> None:
    """A role list a deployment can serve with (ValueError naming what is wrong)."""
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise ValueError(f"worker role {bad[0]!r} is not one of {', '.join(ROLES)}")
    n = Counter(roles)
    if n["prefill"] and not n["decode"]:
        raise ValueError("prefill workers hand their streams to decode workers: at least one "
                         "decode worker is needed")
    if n["decode"] and not n["prefill"]:
        raise ValueError("decode workers take their streams from prefill workers: at least "
                         "one prefill worker is needed (or make them mixed workers)")
    if n["mixed"] and (n["prefill"] or n["decode"]):
        raise ValueError("mixed workers cannot be combined with prefill and decode workers")


def check_exchange(kv: dict[int, dict[str, Any]], roles: list[str]) -> str | None:
    """Why the prefill and decode workers cannot exchange KV (None: they can), from each
    worker's KV description (`WorkerActor.info()["kv"]`, by index): every one of them must
    run the same model geometry, KV dtype and block size (the hand-off copies blocks as
    they are)."""
    parts = [i for i in sorted(kv) if i < len(roles) and roles[i] in ("prefill", "decode")]
    if not parts:
        return None
    ref = parts[0]
    a = kv[ref]
    for i in parts[1:]:
        b = kv[i]
        for key, what in (("model", "model"), ("dtype", "KV dtype"),
                          ("block_size", "KV block size")):
            if a[key] != b[key]:
                return (f"worker-{ref} ({roles[ref]}) and worker-{i} ({roles[i]}) cannot "
                        f"exchange KV: {what} {a[key]} vs {b[key]}; prefill and decode "
                        "workers need the same model, KV dtype and block size")
    return None


@dataclass
class Choice:
    """Where a request goes: `idx` starts it; `handoff_to` decodes it (None: `idx` does)."""

    idx: int
    reason: str
    matched_blocks: int = 0
    handoff_to: int | None = None
    session_idx: int | None = None  # the worker the session is pinned to from now on


class Disagg:
    def __init__(self, cfg: DisaggConfig, roles: list[str], handles: list[Any],
                 views: list[WorkerView], metrics: Any = None) -> None:
        self.cfg = cfg
        self.roles = roles  # per worker index (shared with the router, changed in place)
        self.handles = handles
        self.views = views
        self.metrics = metrics
        self.kv: dict[int, dict[str, Any]] = {}  # each worker's KV description (info())
        self.block_size = 16
        # reservations made since the decode worker's last poll: request -> (dst, blocks, when)
        self.pending: dict[str, tuple[int, int, float]] = {}
        self.inbound: Counter[int] = Counter()  # hand-offs under way, by decode worker
        self.tasks: dict[str, asyncio.Task] = {}  # hand-offs under way, by request
        self.outcomes: Counter[str] = Counter()
        self.local: Counter[str] = Counter()
        self.log: deque[dict[str, Any]] = deque(maxlen=HANDOFF_LOG)

    @property
    def active(self) -> bool:
        return "prefill" in self.roles

    def handoff_cfg(self) -> HandoffConfig:
        return HandoffConfig(lease_s=self.cfg.lease_s, growth_tokens=self.cfg.growth_tokens,
                             failure_policy=self.cfg.failure_policy)

    # ---- the router's view ------------------------------------------------------------------
    def observe(self, idx: int, sent_at: float) -> None:
        """A poll of worker `idx` sent at `sent_at` shows the reservations made before it."""
        self.pending = {r: p for r, p in self.pending.items()
                        if not (p[0] == idx and p[2] < sent_at)}

    def room(self, v: WorkerView) -> int:
        return v.kv_blocks_free - sum(b for d, b, _ in self.pending.values() if d == v.idx)

    def blocks_for(self, prompt_tokens: int, max_tokens: int) -> int:
        want = min(prompt_tokens + max(1, max_tokens), prompt_tokens + self.cfg.growth_tokens)
        return -(-max(want, prompt_tokens + 1) // self.block_size)

    # ---- routing ------------------------------------------------------------------------------
    async def choose(self, room: list[WorkerView], policy: Policy, hashes: list[int],
                     session_worker: int | None, request_id: str, prompt_tokens: int,
                     max_tokens: int, max_len: int, max_imbalance: int) -> Choice:
        """Pick the prefill and decode workers among `room` (alive, not excluded, below
        their in-flight limit) and reserve the decode worker's room; starts the hand-off."""
        old = self.tasks.pop(request_id, None)
        if old is not None and not old.done():  # a retry: its earlier hand-off is called off
            old.cancel()
            await asyncio.wait({old})
        prefill = [v for v in room if self.roles[v.idx] == "prefill"]
        decode = [v for v in room if self.roles[v.idx] == "decode"]
        if not decode:  # only prefill workers left: one serves the request itself
            d = policy.choose(prefill, RouteRequest(hashes, None))
            return self._local(d.idx, "no_decode_worker", d.matched_blocks)
        need = self.blocks_for(prompt_tokens, max_tokens)
        floor = min(self.views[v.idx].load + self.inbound[v.idx] for v in decode)
        fits = [v for v in decode if self.room(v) >= need]

        def load(v: WorkerView) -> tuple[int, int]:
            return v.load + self.inbound[v.idx], -self.room(v)

        ordered = sorted(fits, key=load)
        sess = next((v for v in fits if v.idx == session_worker
                     and load(v)[0] - floor <= max_imbalance), None)
        if sess is not None:
            ordered = [sess] + [v for v in ordered if v is not sess]
        if not ordered:  # no decode worker has room: it waits in the least loaded one's queue
            return self._local(min(decode, key=load).idx, "no_room", 0)
        if prompt_tokens < self.cfg.min_prompt_tokens:
            return self._local(ordered[0].idx, "short_prompt", ordered[0].prefix_match(hashes))
        hit = ordered[0].prefix_match(hashes)
        if hit * self.block_size >= self.cfg.local_prefix_share * prompt_tokens:
            return self._local(ordered[0].idx, "prefix_hit", hit)
        if not prefill:
            return self._local(ordered[0].idx, "no_prefill_worker", hit)
        p = policy.choose(prefill, RouteRequest(hashes, None))
        for v in ordered:
            try:
                blocks = await reserve(RayWorker(self.handles[v.idx], v.worker_id),
                                       reservation(request_id, prompt_tokens, max_len,
                                                   self.kv[p.idx]), self.handoff_cfg())
            except MoveFailed as e:  # no room after all (the poll was stale), or it died
                log.info("decode worker %s cannot reserve for %s: %s", v.worker_id,
                         request_id, e)
                continue
            self.pending[request_id] = (v.idx, blocks, time.monotonic())
            self._start(request_id, p.idx, v.idx, prompt_tokens)
            return Choice(p.idx, "disaggregated", p.matched_blocks, v.idx, v.idx)
        return self._local(ordered[0].idx, "no_room", hit)

    def _local(self, idx: int, reason: str, matched: int) -> Choice:
        self.local[reason] += 1
        if self.metrics:
            self.metrics.local_prefill(reason)
        return Choice(idx, "local_" + reason, matched, None, idx)

    # ---- the hand-off -------------------------------------------------------------------------
    def _start(self, rid: str, src: int, dst: int, prompt_tokens: int) -> None:
        self.inbound[dst] += 1
        task = asyncio.create_task(self._run(rid, src, dst, prompt_tokens))
        self.tasks[rid] = task

        def done(t: asyncio.Task) -> None:
            self.inbound[dst] -= 1
            if self.tasks.get(rid) is t:
                del self.tasks[rid]

        task.add_done_callback(done)

    async def _run(self, rid: str, src: int, dst: int, prompt_tokens: int) -> HandoffResult:
        others = [i for i, r in enumerate(self.roles) if r == "decode" and i != dst
                  and self.views[i].alive]
        others.sort(key=lambda i: -self.room(self.views[i]))
        targets = [(self._worker(i), i) for i in [dst, *others]]
        try:
            res = await hand_off(self._worker(src), self._worker(dst), dst, rid,
                                 self.handoff_cfg(), targets)
        except asyncio.CancelledError:  # a retry of the request (its prefill worker died)
            self._ended(HandoffResult(rid, "gone", error="replaced by a retry"), src, dst,
                        prompt_tokens)
            raise
        except Exception as e:  # a bug: say so, and leave the request to its lease
            log.exception("hand-off of %s failed", rid)
            res = HandoffResult(rid, "failed", error=str(e))
        self._ended(res, src, dst, prompt_tokens)
        return res

    def _ended(self, res: HandoffResult, src: int, dst: int, prompt_tokens: int) -> None:
        rid = res.request_id
        if res.outcome != "moved":  # nothing stays reserved on the decode worker
            self.pending.pop(rid, None)
        self.outcomes[res.outcome] += 1
        self.log.append({"request_id": rid, "outcome": res.outcome, "src": src, "dst": res.dst,
                         "prompt_tokens": prompt_tokens, "seconds": res.seconds,
                         "bytes": res.bytes, "error": res.error, "at": time.time()})
        if self.metrics:
            self.metrics.handoff(res.outcome, res.seconds, res.bytes)
        if res.outcome in ("failed", "recomputed", "kept"):
            log.warning("hand-off of %s from worker %d to %d: %s (%s)", rid, src, dst,
                        res.outcome, res.error)

    def _worker(self, idx: int) -> RayWorker:
        return RayWorker(self.handles[idx], self.views[idx].worker_id)

    def info(self) -> dict[str, Any]:
        return {"active": self.active, "min_prompt_tokens": self.cfg.min_prompt_tokens,
                "local_prefix_share": self.cfg.local_prefix_share,
                "failure_policy": self.cfg.failure_policy, "lease_s": self.cfg.lease_s,
                "handoffs": dict(self.outcomes), "local_prefills": dict(self.local),
                "handoffs_under_way": len(self.tasks)}
