"""RouterActor: the global view of the workers and the single place routing decisions are made.

The router owns the worker actors (so Ray restarts them when they die), polls their load
and held prefix hashes, and answers `pick` with a worker index. It never sees tokens: the
ingress streams from the chosen worker directly, so routing costs one small actor call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any

from ray.exceptions import RayActorError

from kvserve.errors import StartupError
from kvserve.hardware import available_cores
from kvserve.router.autoscale import AutoscalingConfig
from kvserve.router.config import RouterConfig
from kvserve.router.disagg import Disagg, DisaggConfig, check_exchange, check_roles
from kvserve.router.loras import LoraRegistry
from kvserve.router.metrics import RouterMetrics
from kvserve.router.migration import MigrationConfig
from kvserve.router.mover import StreamMover
from kvserve.router.placement import WAITING, PlacementWatch, Verdict
from kvserve.router.policy import Decision, RouteRequest, WorkerView, make_policy
from kvserve.router.scaler import PoolScaler
from kvserve.router.worker_state import WorkerState
from kvserve.workers.placement import worker_bundle
from kvserve.workers.worker_actor import create_worker, device_group_of, stop_worker

log = logging.getLogger(__name__)

ROUTER_NAME = "kvserve-router"
NAMESPACE = "kvserve"
WORKER_NAME_WAIT_S = 60.0  # how long a dead predecessor's worker name may take to be released
RESIZE_DRAIN_TIMEOUT_S = 600.0  # a worker removed by a resize has this long to hand over
PENDING_TTL_S = 5.0  # how long a just-routed prompt counts as held before a poll confirms it
SINGLE_WORKER_POLL_S = 5.0  # poll period with one worker: restart detection only
MAX_SESSIONS = 100_000
PLACEMENT_CHECK_S = 1.0  # how often Ray is asked about workers it has not placed yet
READY_CHECK_S = 0.5  # how often `ready` looks again at workers waiting for resources
MIXED_ONLY = ("autoscaling works on mixed workers only; turn it off before giving workers the "
              "prefill and decode roles")


class RouterActor:
    def __init__(self, router_config: dict[str, Any]) -> None:
        self.cfg = RouterConfig(**router_config)
        # the configuration as deployed, before run-time changes (set_slot_grace_s): its
        # digest names the router; a resize changes only its worker count
        self.deployed = RouterConfig(**router_config)
        self.digest = self.deployed.digest()
        self.policy = make_policy(self.cfg.routing_policy, self.cfg.max_imbalance)
        self.roles = [self.cfg.role_of(i) for i in range(self.cfg.num_workers)]
        check_roles(self.roles)
        if self.cfg.autoscaling.get("enabled") and any(r != "mixed" for r in self.roles):
            raise ValueError(MIXED_ONLY)
        # new workers Ray has not placed yet; those it never placed in time (stopped)
        self.placement = PlacementWatch(self.cfg.placement_timeout_s)
        self.never_placed: set[int] = set()
        self._watcher: asyncio.Task | None = None
        self._answers: dict[int, asyncio.Future] = {}  # first `info` calls under way
        # created side by side: each call returns at once, the loads run in parallel
        self.handles = [self._start_worker(i) for i in range(self.cfg.num_workers)]
        self.views = [WorkerView(i, f"worker-{i}") for i in range(self.cfg.num_workers)]
        self.states = [WorkerState() for _ in self.views]
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.metrics = RouterMetrics(self.policy.name, [v.worker_id for v in self.views],
                                     self.cfg.model_name)
        self.mover = StreamMover(MigrationConfig(**self.cfg.migration), self.handles, self.views,
                                 self.sessions, MAX_SESSIONS, self.metrics.migration, self.roles)
        self.disagg = Disagg(DisaggConfig(**self.cfg.disagg), self.roles, self.handles,
                             self.views, self.metrics.disagg)
        # the pool following the load (off: a fixed pool of num_workers); mixed workers only
        self.scaler = PoolScaler(self, AutoscalingConfig(**self.cfg.autoscaling),
                                 self.metrics.autoscaler)
        # a restarted router starts new workers: the ingress refetches handles when this changes
        self.epoch = uuid.uuid4().hex
        self._poller: asyncio.Task | None = None
        self._info: dict[str, Any] | None = None
        # slots dropped by reconciliation, to tell a premature correction (released later)
        # from a release that never came
        self._reconciled: OrderedDict[str, float] = OrderedDict()
        self.loras = LoraRegistry(self.handles, self.views)

    def __repr__(self) -> str:  # the Ray dashboard's Repr column and log prefix
        return (f"RouterActor({_own_name() or 'unnamed'}, model={self.cfg.model_name}, "
                f"workers={self.cfg.num_workers}, policy={self.cfg.routing_policy})")

    def _start_worker(self, i: int) -> Any:
        engine = self.cfg.worker_engine(available_cores())
        own = _own_name()
        name = worker_actor_name(own, i) if own else None
        deadline = time.monotonic() + WORKER_NAME_WAIT_S
        while True:
            try:
                handle = create_worker(f"worker-{i}", self.cfg.engine_of(i, engine),
                                       self.cfg.num_cpus_per_worker, self.cfg.gpus_of(i),
                                       name=name, namespace=NAMESPACE,
                                       stream_interval_ms=self.cfg.stream_interval_ms,
                                       model_name=self.cfg.model_name,
                                       reporter=_own_handle(),  # start-up progress comes here
                                       role=self.cfg.role_of(i),
                                       handoff_lease_s=float(self.cfg.disagg.get("lease_s", 60.0)))
                self.placement.track(i, handle._actor_id.hex(), worker_bundle(
                    self.cfg.num_cpus_per_worker, self.cfg.gpus_of(i)), device_group_of(handle))
                return handle
            except ValueError as e:
                # the name is still held by the worker of a router that just died (this
                # one's previous incarnation, or one replaced): Ray ends it, as its owner is gone
                if "already taken" not in str(e) or time.monotonic() > deadline:
                    raise
                log.warning("router: worker name %s is still taken; waiting for it", name)
                time.sleep(0.5)

    def _serving(self) -> list[int]:
        """Workers that are neither drained (stopped) nor draining."""
        gone = self.mover.drained | self.mover.draining
        return [v.idx for v in self.views if v.idx not in gone]

    # ---- setup ------------------------------------------------------------------------------
    async def ready(self, wait_for_all: bool = False) -> dict[str, Any]:
        """Wait until the serving workers have loaded their model; start polling. Returns
        model info. (A draining worker may stop meanwhile: it is not waited for.)

        A worker being restarted is not waited for: Ray fails calls to it at once, and it
        may wait for a node with room for a long time (its node was lost); the polls
        notice it back. A worker that is starting for the first time is waited for, unless
        it waits for resources (no node has room for it yet, router/placement.py) and
        another worker is ready: it joins once placed and loaded. `wait_for_all` waits for
        every worker, and fails if one could not be placed in time."""
        self._watch_placement()
        live = self._serving()
        calls = {i: self._answer(i) for i in live}
        while True:
            failed = [i for i in live if i in self.never_placed]
            if wait_for_all and failed:
                raise StartupError(_states_text(self.views, self.states, failed))
            unanswered = [f for f in calls.values() if not f.done()]
            if not unanswered:
                break
            # the others wait for resources, or the service served before: the workers
            # still loading (started by a resize or the autoscaler) join once they answer
            if not wait_for_all and any(_answered(f) for f in calls.values()) and (
                    self._info is not None
                    or all(self._unplaced(i) for i, f in calls.items() if not f.done())):
                break
            await asyncio.wait(unanswered, timeout=READY_CHECK_S)
        answered, errors = [], []
        for i, f in calls.items():
            if not f.done():  # waits for resources: recorded when it answers (_late_answer)
                continue
            info = self._record(i, f.result())
            if info is None:
                errors.append(f.result())
            else:
                answered.append(info)
        if not answered and self._info is None:
            failed = [i for i in live if i in self.never_placed]
            if failed:
                raise StartupError("no worker started: "
                                   + _states_text(self.views, self.states, failed))
            if not errors:
                raise StartupError("no worker to wait for (every worker is draining)")
            raise errors[0]
        self._check_exchange()
        if self._info is None:  # the context served is the shortest any worker holds
            self._info = {**answered[0],
                          "max_model_len": min(int(a["max_model_len"]) for a in answered)}
            self.loras.started(answered)
        self.mover.block_size = int(self._info.get("block_size", self.mover.block_size))
        self.disagg.block_size = self.mover.block_size
        await self._poll_once()
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_loop())
        return self._info

    def _check_exchange(self) -> None:
        """Prefill and decode workers whose KV cannot be exchanged fail the start, the
        reason shown as their start-up state (`kvserve serve` prints it)."""
        why = check_exchange(self.disagg.kv, self.roles)
        if why is None:
            return
        for i, r in enumerate(self.roles):
            if r != "mixed":
                self.states[i].report(self.states[i].incarnation, f"failed: {why}", 0.0)
        raise ValueError(why)

    def _answer(self, i: int) -> asyncio.Future:
        """Worker i's answer to `info` (it answers once loaded): its info, or the error.
        One call at a time; whoever waits for it or not, the answer is recorded."""
        f = self._answers.get(i)
        if f is None or f.done():
            async def call() -> Any:
                try:
                    return await self.handles[i].info.remote()
                except Exception as e:
                    return e

            f = self._answers[i] = asyncio.ensure_future(call())
            f.add_done_callback(lambda f, i=i: self._late_answer(i, f.result()))
        return f

    def _record(self, i: int, info: Any) -> dict[str, Any] | None:
        """Worker i answered `info` (or failed to): alive and ready, or lost."""
        v = self.views[i]
        if isinstance(info, BaseException):
            if not isinstance(info, RayActorError):
                raise info
            v.alive = False
            self.states[i].lost()
            return None
        v.alive, v.incarnation, v.node_id = True, info["incarnation"], info.get("node_id", "")
        self.states[i].ready(info.get("load_s", 0.0))
        self.placement.forget(i)
        if "kv" in info:
            self.disagg.kv[i] = info["kv"]
        self.scaler.worker_ready(i, float(info.get("load_s", 0.0)))
        return info

    def _late_answer(self, i: int, info: Any) -> None:
        """Record worker i's answer, also where nobody waits for it (a worker that waited
        for resources, or the workers of a restarted router, whose `ready` nobody calls)."""
        if i in self.mover.drained or i in self.never_placed:
            return
        was_alive = self.views[i].alive
        try:
            if self._record(i, info) is not None:
                self._refuse_unexchangeable(i)
                if not was_alive and self.views[i].alive:
                    log.warning("router: %s is ready (node %s)", self.views[i].worker_id,
                                info.get("node_id", "?"))
        except Exception as e:
            log.error("router: %s failed to start: %s", self.views[i].worker_id, e)
        self.metrics.workers_alive(self.views)

    def _refuse_unexchangeable(self, i: int) -> None:
        """A prefill or decode worker that answered after the start (it waited for
        resources) and whose KV the others cannot exchange takes no request."""
        if self._info is None or self.roles[i] == "mixed":
            return  # (during the start, `ready` checks all of them at once)
        why = check_exchange(self.disagg.kv, self.roles)
        if why is not None and f"worker-{i} " in why:
            self.views[i].alive = False
            self.states[i].report(self.states[i].incarnation, f"failed: {why}", 0.0)
            log.error("router: %s refused: %s", self.views[i].worker_id, why)

    def _unplaced(self, i: int) -> bool:
        """Worker i waits for resources, or was never placed: `ready` need not wait for it."""
        return i in self.never_placed or self.states[i].state.startswith(WAITING)

    # ---- placement --------------------------------------------------------------------------
    def _watch_placement(self) -> None:
        """Watch the workers Ray has not placed yet (started with the first `ready` or
        `pick`, and again after new workers started)."""
        if self.placement.watching() and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.create_task(self._placement_loop())

    async def _placement_loop(self) -> None:
        while self.placement.watching():
            try:
                verdicts = await asyncio.to_thread(self.placement.check)
            except Exception:
                log.exception("router: asking Ray about the workers' placement failed")
                verdicts = {}
            for i, verdict in verdicts.items():
                self._placement_verdict(i, verdict)
            await asyncio.sleep(PLACEMENT_CHECK_S)

    def _placement_verdict(self, i: int, verdict: Verdict) -> None:
        state = self.states[i]
        if i in self.mover.drained or not state.unreported():
            return  # the worker reports its own progress once it runs: that wins
        wid = self.views[i].worker_id
        if verdict.kind == "placed":
            if state.state != "starting":
                log.warning("router: %s has been placed", wid)
                state.state = "starting"
        elif verdict.kind == "failed":
            state.state = verdict.state
            self.never_placed.add(i)
            self.views[i].alive = False
            log.error("router: %s %s; stopped it", wid, verdict.state)
            stop_worker(self.handles[i])  # so that it takes no node later
        elif verdict.state != state.state:
            if verdict.kind == "waiting":
                log.warning("router: %s is %s (no node has them free)", wid, verdict.state)
            state.state = verdict.state

    def config_digest(self) -> str:
        return self.digest

    def shape_digest(self) -> str:
        return self.deployed.shape_digest()

    def resize(self, num_workers: int,
               autoscaling: dict[str, Any] | None = None) -> dict[str, Any]:
        """Serve `num_workers` workers (a deployment that changed only its worker count or
        its autoscaling settings).

        `autoscaling` (a redeploy passes it: {} turns autoscaling off) replaces the
        autoscaling settings; while autoscaling is on, the policy owns the worker count
        (`num_workers` is only where a new router starts), and enforces the new bounds at
        its next poll. Otherwise, fewer: the highest-numbered serving workers are drained in
        the background (they take no new request from now on; their streams and sessions
        move to the others, then they stop). More: new workers start after the existing ones
        (their indices are new; the ingress picks up the new handles through the changed
        epoch). Returns the workers draining and started."""
        n = max(1, int(num_workers))
        if any(r != "mixed" for r in self.roles):
            raise ValueError("a deployment with prefill and decode workers is replaced, not "
                             "resized in place")
        if autoscaling is not None:
            on = AutoscalingConfig(**autoscaling) if autoscaling else AutoscalingConfig()
            self.scaler.configure(dataclasses.asdict(on))
            self.cfg.autoscaling = self.deployed.autoscaling = dict(autoscaling)
        self.cfg.num_workers = self.deployed.num_workers = n  # new workers' thread share
        removed: list[int] = []
        added: list[int] = []
        if not self.scaler.cfg.enabled:
            serving = self._serving()
            removed = serving[n:]
            for i in removed:
                task = self.mover.start_drain(i, RESIZE_DRAIN_TIMEOUT_S)
                task.add_done_callback(lambda t, i=i: self._resize_drained(i, t))
            added = self._add_workers(n - len(serving))
        self.digest = self.deployed.digest()
        log.warning("router: resized to %d workers (draining %s, started %s)", n, removed, added)
        return {"draining": removed, "started": added}

    def _add_workers(self, k: int) -> list[int]:
        """Start `k` new workers after the existing ones; returns their indices."""
        added = []
        for _ in range(max(0, k)):
            i = len(self.handles)
            self.handles.append(self._start_worker(i))
            self.roles.append("mixed")
            self.views.append(WorkerView(i, f"worker-{i}"))
            self.states.append(WorkerState())
            self.mover.add_worker(i)
            added.append(i)
        if added:
            self.epoch = uuid.uuid4().hex  # the ingress refetches the handles
            with contextlib.suppress(RuntimeError):  # (no loop here: `ready` starts it)
                self._watch_placement()
        return added

    def set_autoscaling(self, **changes: Any) -> dict[str, Any]:
        """Change autoscaling settings at run time (operators, benches, tests): min_workers,
        max_workers, delays, thresholds, `enabled`. Returns the settings now in force;
        ValueError names a bad one. The policy applies them at its next poll."""
        if changes.get("enabled") and any(r != "mixed" for r in self.roles):
            raise ValueError(MIXED_ONLY)
        return dataclasses.asdict(self.scaler.configure(changes))

    def _resize_drained(self, idx: int, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        res = task.exception() or task.result()
        if isinstance(res, BaseException) or not res.get("drained"):
            log.error("router: worker %d, removed by a resize, did not drain: %s", idx, res)

    def workers(self) -> list[Any]:
        return list(self.handles)

    def workers_with_epoch(self) -> tuple[str, list[Any]]:
        return self.epoch, list(self.handles)

    def stop_workers(self) -> int:
        """Stop every worker for good and free the tensor-parallel workers' placement groups
        (called before this router is killed: Ray removes those groups with a detached
        router, but a router some driver owns would leave them holding their CPUs and GPUs
        until that driver ends). Returns how many workers there were."""
        for h in self.handles:
            stop_worker(h)
        return len(self.handles)

    # ---- routing ----------------------------------------------------------------------------
    async def pick(
        self, block_hashes: list[int], session_id: str | None, exclude: list[int],
        request_id: str = "", lora: str | None = None, prompt_tokens: int = 0,
        max_tokens: int = 0,
    ) -> dict[str, Any]:
        """Choose a worker; {"idx", "worker_id", "slot_id", "reason", ...} or {"error", "message"}.
        `lora`: the LoRA adapter the request names (workers holding it are preferred).

        The request counts against the worker under `slot_id` until `release(idx, slot_id)`.
        With prefill and decode workers (router/disagg.py) `idx` is where the request starts
        and `handoff_to` (when set) the decode worker its stream is handed to after its
        first token, which has reserved room for it."""
        if self._poller is None:  # a restarted router: nobody called ready(); start polling
            self._poller = asyncio.create_task(self._poll_loop())
            self._watch_placement()
        alive = self._routable(exclude)
        # (before any wait: a request naming an unknown adapter does not start a worker)
        if lora is not None and lora not in self.loras.known and self.loras.initialized:
            return {"error": "not_found", "message": f"no LoRA adapter named {lora!r} is loaded"}
        if not alive and not exclude and self.scaler.cfg.enabled:
            # none serves (scaled to zero, or all starting): wait in a bounded queue while one
            # starts; a timeout's answer is final (the ingress does not wait again)
            refused = await self.scaler.wait_for_worker()
            if refused is not None:
                return refused
            alive = self._routable(exclude)
        if lora is not None and lora not in self.loras.known and not self.loras.initialized \
                and alive:
            await self.loras.learn(alive[0].idx)  # a restarted router, not yet ready
        if lora is not None and lora not in self.loras.known and self.loras.initialized:
            return {"error": "not_found", "message": f"no LoRA adapter named {lora!r} is loaded"}
        if not alive:
            return {"error": "unavailable", "message": "no worker is available to take the request"}
        if lora is not None:
            alive = self.loras.holders(alive, lora)
        room = [v for v in alive if v.inflight < self.cfg.max_inflight_per_worker]
        if not room:
            return {"error": "overloaded",
                    "message": f"all {len(alive)} workers are at their limit of "
                               f"{self.cfg.max_inflight_per_worker} requests in flight; retry later"}
        sw = self.sessions.get(session_id) if session_id else None
        handoff_to: int | None = None
        pinned: int | None = None
        if self.disagg.active and not lora:
            c = await self.disagg.choose(
                room, self.policy, block_hashes, sw, request_id, prompt_tokens, max_tokens,
                min(prompt_tokens + max(1, max_tokens), int((self._info or {}).get(
                    "max_model_len", prompt_tokens + max_tokens))), self.cfg.max_imbalance)
            d = Decision(c.idx, c.reason, c.matched_blocks)
            handoff_to, pinned = c.handoff_to, c.session_idx
        else:  # (a request naming a LoRA adapter is prefilled where it decodes)
            if self.disagg.active:
                room = [v for v in room if self.roles[v.idx] == "decode"] or room
            d = self.policy.choose(room, RouteRequest(block_hashes, sw, lora))
        v = self.views[d.idx]
        if lora is not None:  # it loads the adapter now if it lacks it: held from here on
            v.lora_host.add(lora)
        self.metrics.picked(d, v, block_hashes, retry=bool(exclude))
        slot_id = f"{request_id}@{uuid.uuid4().hex[:12]}"
        v.slots[slot_id] = time.monotonic()
        v.inflight = len(v.slots)
        expiry = time.monotonic() + PENDING_TTL_S
        for h in block_hashes:
            v.pending[h] = expiry
        if session_id:
            if request_id:
                self.mover.note_request(request_id, session_id)
            home = d.idx if pinned is None else pinned
            if not self.disagg.active:
                self.mover.session_routed(session_id, sw, home, block_hashes, exclude)
            self.mover.note_session(session_id, block_hashes)
            self.sessions[session_id] = home
            self.sessions.move_to_end(session_id)
            if len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        out = {"idx": d.idx, "worker_id": v.worker_id, "slot_id": slot_id, "reason": d.reason,
               "matched_blocks": d.matched_blocks, "epoch": self.epoch}
        if handoff_to is not None:
            out.update(handoff_to=handoff_to,
                       handoff_worker_id=self.views[handoff_to].worker_id)
        return out

    def _routable(self, exclude: list[int]) -> list[WorkerView]:
        return [v for v in self.views if v.alive and v.idx not in exclude
                and v.idx not in self.mover.draining and v.idx not in self.mover.drained]

    def release(self, idx: int, slot_id: str) -> bool:
        """Stop counting a slot; a second release of it (or of one already reconciled away,
        or from before a router restart) is ignored. Returns whether it was counted."""
        v = self.views[idx]
        if v.slots.pop(slot_id, None) is None:
            v.duplicate_releases += 1
            if self._reconciled.pop(slot_id, None) is not None:
                # the ingress still had it: the correction came too early (raise slot_grace_s)
                v.late_releases += 1
            return False
        v.inflight = len(v.slots)
        return True

    def move_slot(self, src: int, dst: int, slot_id: str) -> None:
        """A request's stream moved from worker `src` to `dst`: so does its slot (a slot
        already released or reconciled away stays gone)."""
        s, d = self.views[src], self.views[dst]
        if s.slots.pop(slot_id, None) is None:
            return
        d.slots[slot_id] = time.monotonic()
        s.inflight, d.inflight = len(s.slots), len(d.slots)

    async def move_stream(self, request_id: str, src: int, dst: int,
                          method: str = "auto") -> dict[str, Any]:
        """Move one unfinished request's stream to another worker (tests, tools)."""
        return await self.mover.move(request_id, src, dst, "operator", method)

    async def move_request(self, request_id: str, worker: int | None = None,
                           method: str = "auto") -> dict[str, Any]:
        """An operator's move: find the worker serving `request_id` and move the stream to
        `worker` (None: the serving worker with the most free KV). Errors carry a `code`:
        not_found (no such request), invalid (no such target), no_room (the target
        cannot take it; the stream is untouched), failed."""
        if worker is not None and not 0 <= worker < len(self.views):
            return {"error": f"no worker {worker}; workers are worker-0..worker-"
                             f"{len(self.views) - 1}", "code": "invalid"}
        src = await self._serving_worker(request_id)
        if src is None:
            return {"error": f"no unfinished request {request_id!r} on any worker",
                    "code": "not_found"}
        ok = [v for v in self.views if v.alive and v.idx != src
              and v.idx not in self.mover.draining and v.idx not in self.mover.drained]
        if worker is None:
            if not ok:
                return {"error": "no other worker is available to take the stream",
                        "code": "no_room"}
            reserved = self.mover.reserved()
            worker = max(ok, key=lambda v: v.kv_blocks_free - reserved.get(v.idx, 0)).idx
        elif worker == src:
            return {"error": f"request {request_id!r} is already on worker-{src}",
                    "code": "invalid"}
        elif worker not in {v.idx for v in ok}:
            return {"error": f"worker-{worker} is not serving (dead, draining or drained)",
                    "code": "invalid"}
        res = await self.mover.move(request_id, src, worker, "operator", method)
        if "error" in res:
            if res.get("refused"):  # by the target (no room, ...) or the source (it ended)
                res["code"] = "no_room" if res.get("side") != "source" else "not_found"
            else:
                res["code"] = "failed"
        res["src_worker"], res["dst_worker"] = f"worker-{src}", f"worker-{worker}"
        return res

    async def _serving_worker(self, request_id: str) -> int | None:
        live = [v.idx for v in self.views if v.alive and v.idx not in self.mover.drained]
        answers = await asyncio.gather(
            *(self.handles[i].unfinished_ids.remote() for i in live), return_exceptions=True)
        for i, ids in zip(live, answers, strict=True):
            if not isinstance(ids, BaseException) and request_id in ids:
                return i
        return None

    async def drain(self, idx: int, timeout_s: float = 600.0) -> dict[str, Any]:
        """Stop admitting to worker `idx`, move its streams to the others, stop it."""
        if not 0 <= idx < len(self.views):
            return {"error": f"no worker {idx}; workers are 0..{len(self.views) - 1}"}
        return await self.mover.drain(idx, timeout_s)

    def worker_state(self, worker_id: str, incarnation: str, state: str, load_s: float) -> None:
        """A worker's start-up progress ("loading", "capturing graphs 3/9", "ready")."""
        idx = int(worker_id.rsplit("-", 1)[1])
        if 0 <= idx < len(self.states) and idx not in self.never_placed:
            self.states[idx].report(incarnation, state, load_s)

    def report_failure(self, idx: int) -> None:
        """The ingress saw this worker die: stop routing to it until a poll finds it back."""
        v = self.views[idx]
        if v.alive:
            log.warning("worker %s reported dead; waiting for its restart", v.worker_id)
        v.alive = False
        self.metrics.workers_alive(self.views)

    # ---- polling ----------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        while True:
            # With one worker there is nothing to choose between: poll only to notice a
            # restart. Each poll interrupts the worker's step loop, which on a small CPU
            # host costs more than it tells (see docs/benchmarks.md, online serving).
            # An autoscaled pool is polled every period whatever its size: its load decides.
            interval = self.cfg.load_poll_interval_s
            if len(self.views) - len(self.mover.drained) == 1 and not self.scaler.active:
                interval = max(interval, SINGLE_WORKER_POLL_S)
            await asyncio.sleep(interval)
            try:
                await self._poll_once()
                self.mover.tick()
                self.scaler.tick()
            except Exception:
                log.exception("polling workers failed")

    async def _poll_once(self) -> None:
        async def one(v: WorkerView) -> None:
            sent_at = time.monotonic()
            try:
                load = await asyncio.wait_for(self.handles[v.idx].load.remote(), timeout=5.0)
            except Exception:  # dead or restarting: Ray brings it back, a later poll notices
                load = None
            if v.idx in self.mover.drained:  # stopped for good while the poll was out
                return
            if load is None:
                v.alive = False
                self.states[v.idx].lost()
                return
            self.states[v.idx].answered()
            self._update(v, load)
            self.mover.observe(v.idx, load, sent_at)
            self.disagg.observe(v.idx, sent_at)

        # not those that never answered yet: a call to an actor Ray has not placed would
        # wait in its queue (and pile up there); their first answer makes them alive
        polled = [v for v in self.views
                  if v.idx not in self.mover.drained and v.idx not in self.never_placed]
        for v in polled:
            if not v.incarnation:
                self._answer(v.idx)
        await asyncio.gather(*(one(v) for v in polled if v.incarnation))
        self.metrics.workers_alive(self.views)
        self.scaler.wake()

    def _update(self, v: WorkerView, load: dict[str, Any]) -> None:
        if load["incarnation"] != v.incarnation:
            # a replaced worker starts with an empty cache: forget its sessions and prefixes
            if v.incarnation:
                v.restarts += 1
                log.warning("worker %s was restarted (%d restarts), on node %s", v.worker_id,
                            v.restarts, load.get("node_id", "?"))
            v.incarnation = load["incarnation"]
            v.node_id = load.get("node_id", "")
            v.pending.clear()
            for s in [s for s, i in self.sessions.items() if i == v.idx]:
                del self.sessions[s]
        v.alive = True
        v.running, v.waiting, v.parked = load["running"], load["waiting"], load["parked"]
        v.kv_blocks_free, v.kv_blocks_total = load["kv_blocks_free"], load["kv_blocks_total"]
        v.held_device = set(load["held"].get("device", ()))
        v.held_host = set(load["held"].get("host", ()))
        v.stats = load["stats"]
        v.devices = load.get("devices", [])
        v.runtime = load.get("runtime", {})
        v.streams = load.get("stream_list", [])
        loras = load.get("loras") or {}
        v.loras = set(loras.get("loaded", ()))
        v.lora_device, v.lora_host = set(loras.get("device", ())), set(loras.get("host", ()))
        self.loras.check(v)  # a restarted worker gets the adapters loaded since the start
        now = time.monotonic()
        v.ttft_recent = [(now - age, s) for age, s in load.get("ttft_recent", ())]
        v.pending = {h: t for h, t in v.pending.items() if t > now}
        self._reconcile(v, set(load.get("slots", ())), now)

    def _reconcile(self, v: WorkerView, on_worker: set[str], now: float) -> None:
        """Second line of defence against a lost release: a slot is confirmed while its
        worker runs or streams the request; one the worker has not known for longer than
        the grace period (which covers the trip from pick to the worker) is dropped."""
        for slot_id, seen in list(v.slots.items()):
            if slot_id in on_worker:
                v.slots[slot_id] = now
            elif now - seen > self.cfg.slot_grace_s:
                del v.slots[slot_id]
                v.reconciled += 1
                self._reconciled[slot_id] = now
                while len(self._reconciled) > MAX_SESSIONS // 10:
                    self._reconciled.popitem(last=False)
                log.warning("router: worker %s no longer has request slot %s (unknown to it for "
                            "%.0f s, release never came); dropped it from its in-flight count "
                            "(%d corrections so far)", v.worker_id, slot_id, now - seen,
                            v.reconciled)
        v.inflight = len(v.slots)

    def set_migration(self, enabled: bool, rebalance: bool | None = None,
                      park_threshold_s: float | None = None) -> bool:
        """Turn planned migrations on or off at run time (benches, operators, tests), and
        optionally the live rebalancing of running streams and the parked streams' threshold;
        returns the old on/off setting. Explicit moves and drains work either way."""
        cfg = self.mover.cfg
        old, cfg.enabled = cfg.enabled, bool(enabled)
        if rebalance is not None:
            cfg.rebalance = bool(rebalance)
        if park_threshold_s is not None:
            cfg.park_threshold_s = float(park_threshold_s)
        return old

    async def set_roles(self, roles: list[str]) -> list[str]:
        """Give the workers these roles (mixed, prefill, decode) at run time: operators,
        benches and tests compare disaggregated and mixed serving on the same workers. The
        workers keep their engines; their KV must be exchangeable. Returns the old roles."""
        roles = list(roles)
        if len(roles) != len(self.views):
            raise ValueError(f"{len(roles)} roles for {len(self.views)} workers")
        check_roles(roles)
        if self.scaler.cfg.enabled and any(r != "mixed" for r in roles):
            raise ValueError(MIXED_ONLY)
        live = self._serving()
        infos = await asyncio.gather(*(self.handles[i].info.remote() for i in live))
        kv = {i: info["kv"] for i, info in zip(live, infos, strict=True)}
        why = check_exchange(kv, roles)
        if why is not None:
            raise ValueError(why)
        await asyncio.gather(*(self.handles[i].set_role.remote(roles[i]) for i in live))
        self.disagg.kv.update(kv)
        old = list(self.roles)
        self.roles[:] = roles  # (shared with the mover and the disaggregation, in place)
        self.sessions.clear()  # pinned to workers whose roles changed
        if self.disagg.active:
            self.metrics.disagg.zero()
        return old

    def handoff_log(self) -> list[dict[str, Any]]:
        """The latest hand-offs (up to router/disagg.py's HANDOFF_LOG): outcome, prompt
        tokens, seconds and bytes of each (benches)."""
        return list(self.disagg.log)

    def set_disagg(self, **settings: Any) -> dict[str, Any]:
        """Change DisaggConfig settings (min_prompt_tokens, local_prefix_share,
        failure_policy, lease_s) at run time (benches, tests); returns the old ones."""
        cfg = self.disagg.cfg
        unknown = [k for k in settings if not hasattr(cfg, k)]
        if unknown:
            raise ValueError(f"no disaggregation setting {unknown[0]!r}")
        old = {k: getattr(cfg, k) for k in settings}
        self.disagg.cfg = DisaggConfig(**{**dataclasses.asdict(cfg), **settings})
        return old

    def set_max_inflight_per_worker(self, n: int) -> int:
        """Change the overload limit at run time (operators, tests); returns the old one."""
        old, self.cfg.max_inflight_per_worker = self.cfg.max_inflight_per_worker, max(1, int(n))
        return old

    def set_slot_grace_s(self, s: float) -> float:
        """Change the reconciliation grace period at run time; returns the old one."""
        old, self.cfg.slot_grace_s = self.cfg.slot_grace_s, max(0.0, float(s))
        return old

    # ---- LoRA adapters ----------------------------------------------------------------------
    async def load_lora(self, name: str, source: str) -> dict[str, Any]:
        """Load a LoRA adapter on every serving worker (all or none): its description, or
        {"error", "kind"}."""
        live = [i for i in self._serving() if self.views[i].alive]
        return await self.loras.load(name, source, live)

    async def unload_lora(self, name: str) -> dict[str, Any]:
        live = [i for i in self._serving() if self.views[i].alive]
        return await self.loras.unload(name, live)

    def list_loras(self) -> list[dict[str, Any]]:
        return self.loras.listing()

    # ---- introspection ----------------------------------------------------------------------
    def server_info(self) -> dict[str, Any]:
        return {
            "routing_policy": self.policy.name,
            "node_id": _own_node(),  # the router's Ray node (the head, see lifecycle.py)
            "model_info": self._info,
            "slot_grace_s": self.cfg.slot_grace_s,
            "autoscaling": self.scaler.info(),
            "workers": [
                {"idx": v.idx, "worker_id": v.worker_id, "node_id": v.node_id,
                 "alive": v.alive, "inflight": v.inflight,
                 "running": v.running, "waiting": v.waiting, "parked": v.parked,
                 "kv_blocks_free": v.kv_blocks_free, "kv_blocks_total": v.kv_blocks_total,
                 "held_device_blocks": len(v.held_device), "held_host_blocks": len(v.held_host),
                 "restarts": v.restarts, "reconciled_slots": v.reconciled,
                 "duplicate_releases": v.duplicate_releases, "late_releases": v.late_releases,
                 "stats": {**v.stats, **self.mover.stats(v.idx)},
                 "state": self._state(v.idx), "load_s": self.states[v.idx].load_s,
                 "tensor_parallel_size": max(1, len(v.devices)), "devices": v.devices,
                 "runtime": v.runtime, "streams": v.streams,
                 "loras": {"device": sorted(v.lora_device), "host": sorted(v.lora_host)},
                 "role": self.roles[v.idx]}
                for v in self.views
            ],
            "loras": self.loras.listing(),
            "disagg": self.disagg.info(),
        }


    def _state(self, idx: int) -> str:
        if idx in self.mover.drained:
            return "drained"
        if idx in self.mover.draining:
            return "draining"
        return self.states[idx].state


def _answered(f: asyncio.Future) -> bool:
    return f.done() and not isinstance(f.result(), BaseException)


def _states_text(views: list[WorkerView], states: list[WorkerState], idx: list[int]) -> str:
    return "; ".join(f"{views[i].worker_id}: {states[i].state}" for i in idx)


def worker_actor_name(router_name: str, idx: int) -> str:
    """The Ray actor name of a router's worker `idx`: "kvserve-worker-0" for the router
    "kvserve-router" (another router's workers take their names from it)."""
    base = router_name.removesuffix("-router")
    return f"{base}-worker-{idx}"


def _own_name() -> str:
    """This actor's name ("" outside Ray or unnamed)."""
    import ray

    try:
        return ray.get_runtime_context().get_actor_name() or ""
    except Exception:
        return ""


def _own_node() -> str:
    """The Ray node this actor runs on ("" outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def _own_handle() -> Any:
    """This actor's handle (None outside Ray: nobody to report to)."""
    import ray

    try:
        return ray.get_runtime_context().current_actor
    except Exception:
        return None
