"""WorkerActor: one AsyncLLMEngine in a Ray actor, streaming coalesced chunks to the ingress.

The ingress reaches a request's chunks through its subscription (token_batches.py: one Ray
item per engine step for all of that ingress replica's requests here); `generate` and
`resume` are the per-request streams those batches are made of. Each request's outputs are pumped from the engine into a per-request buffer; the Ray
streaming generator yields everything buffered so far as one chunk. Chunks are paced
(stream_pacing.py): the first and last go at once, the others at most once per interval,
the steps in between merged; when the consumer falls behind (Ray's generator backpressure
pauses the yield), steps merge too, instead of becoming one Ray object per token.
Dropping or cancelling the stream, or `abort`, aborts the request in the engine, which
frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import ray

from kvserve.config import EngineConfig
from kvserve.errors import InvalidRequestError, NotFoundError, OutOfKVCacheError
from kvserve.models import resolve_model, served_name
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.workers.engine.async_engine import AsyncLLMEngine, HandoffFailed
from kvserve.workers.engine.engine import LLMEngine
from kvserve.workers.engine.live_move import LEASE_S
from kvserve.workers.engine.migration import StreamMoved
from kvserve.workers.engine.snapshot import model_geometry
from kvserve.workers.metrics import RequestTracker, WorkerMetrics
from kvserve.workers.placement import worker_bundle
from kvserve.workers.stream_moves import StreamMoves
from kvserve.workers.stream_pacing import StreamPacing
from kvserve.workers.token_batches import Subscription, TokenBatches

log = logging.getLogger(__name__)

# Unconsumed chunks a stream may have in flight before the worker's yield waits (and the
# steps produced meanwhile coalesce into one chunk).
STREAM_BACKPRESSURE = 1
METRICS_PERIOD_S = 1.0
WORKER_PLACEMENT = "SPREAD"  # see worker_options
PARKED_KEYS = ("parked", "parked_streams", "host_parked_streams", "num_parked")
# what a worker does (disaggregated serving): prefill prompts and hand the streams over,
# decode streams handed to it (and prefill short prompts itself), or both (the default)
ROLES = ("mixed", "prefill", "decode")


def _metric_name(key: str) -> str:
    return "kvserve_worker_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class _Request:
    """Outputs of one request, buffered between the engine pump and the stream."""

    def __init__(self, slot_id: str | None) -> None:
        self.slot_id = slot_id  # the router's slot for it (reported on `load`)
        self.aborted = False
        self.outs: list[RequestOutput] = []
        self.error: BaseException | None = None
        self.done = False
        self.event = asyncio.Event()
        self.task: asyncio.Task | None = None

    def take_chunk(self, worker_id: str) -> dict[str, Any]:
        outs, self.outs = self.outs, []
        last = outs[-1]
        chunk = {
            "token_ids": [t for o in outs for t in o.delta_token_ids],
            "text": "".join(o.delta_text for o in outs),
            "finish_reason": last.finish_reason,
            "stop_reason": None if last.stop_reason is None else str(last.stop_reason),
            "usage": [last.usage.prompt_tokens, last.usage.cached_tokens,
                      last.usage.completion_tokens],
            "worker_id": worker_id,
        }
        if last.logprobs is not None:
            chunk["logprobs"], chunk["top_logprobs"] = _chunk_logprobs(outs)
        return chunk


def _chunk_logprobs(outs: list[RequestOutput]) -> tuple[list[float], list[list] | None]:
    """The logprobs of these outputs' new tokens (their lists keep growing: slice by position)."""
    lps: list[float] = []
    tops: list[list] | None = [] if outs[-1].top_logprobs is not None else None
    for o in outs:
        n = o.usage.completion_tokens
        k = n - len(o.delta_token_ids)
        lps.extend((o.logprobs or [])[k:n])
        if tops is not None:
            tops.extend([list(p) for p in row] for row in (o.top_logprobs or [])[k:n])
    return lps, tops


class WorkerActor(StreamMoves, TokenBatches):
    """Ray actor body (wrapped with ray.remote by `create_worker`)."""

    def __init__(
        self, worker_id: str, engine_config: dict[str, Any],
        stream_interval_ms: float | None = None, on_gpu: bool = False, model_name: str = "",
        reporter: Any = None, role: str = "mixed", handoff_lease_s: float = LEASE_S,
    ) -> None:
        """`reporter` (the router) hears the start-up's progress: `worker_state(worker_id,
        incarnation, state, load_s)` with "downloading <model>: <bytes> of <bytes> ..." (a Hub
        name not in this node's cache yet), "loading", "capturing graphs i/n", then "ready";
        the actor answers no call before it is ready, so this is how it shows meanwhile."""
        self.worker_id = worker_id
        if role not in ROLES:
            raise ValueError(f"worker role {role!r} is not one of {', '.join(ROLES)}")
        self.role = role
        self.handoff_lease_s = handoff_lease_s  # a prefilled stream waits this long to be sent
        self.pacing = StreamPacing.from_config(stream_interval_ms, on_gpu)
        # changes on every (re)start: lets the router notice that the actor was replaced
        self.incarnation = uuid.uuid4().hex
        self.node_id = _node_id()  # the Ray node it runs on (a restart may land elsewhere)
        self.started_at = time.time()
        self.config = EngineConfig(**engine_config)
        self._reporter = reporter
        _log_info_in_actor()
        t0 = time.monotonic()
        try:
            # a Hub name is fetched here, into this node's cache, its bytes shown as the state
            path = resolve_model(self.config.model,
                                 progress=lambda p: self._report(p.state(), 0.0))
            engine = LLMEngine(self.config.model_copy(update={"model": path}),
                               lambda state: self._report(state, 0.0))
        except Exception as e:
            self._report(f"failed: {e}", time.monotonic() - t0)
            raise
        self.engine = AsyncLLMEngine(self.config, engine, on_dead=self._engine_died)
        self.load_s = time.monotonic() - t0
        self._report("ready", self.load_s)
        self.model_name = model_name or served_name(self.config.model)
        self._devices = self.devices()
        self.metrics = WorkerMetrics(self.model_name, worker_id, role)
        self._requests: dict[str, _Request] = {}
        self._subs: dict[str, Subscription] = {}
        self._gauges: dict[str, Any] = {}
        self._metrics_task: asyncio.Task | None = None
        self.served = 0

    def __repr__(self) -> str:  # the Ray dashboard's Repr column and log prefix
        config = getattr(self, "config", None)
        device = config.resolved_device() if config is not None else "?"
        gpus = _gpu_ids()
        if gpus:
            device += f" (GPU {','.join(gpus)})"
        model = getattr(self, "model_name", "?")
        tp = f", tensor_parallel_size={config.tensor_parallel_size}" \
            if config is not None and config.tensor_parallel_size > 1 else ""
        role = getattr(self, "role", "mixed")
        role = f", role={role}" if role != "mixed" else ""
        return (f"WorkerActor({getattr(self, 'worker_id', '?')}, model={model}, "
                f"device={device}{tp}{role})")

    def devices(self) -> list[str]:
        """Each rank's device, with the GPU Ray gave it ("cuda:1 (GPU 5)")."""
        gpus = _gpu_ids()
        out = []
        for r, dev in enumerate(self.config.rank_devices()):
            i = int(dev[5:]) if dev.startswith("cuda:") else r
            out.append(f"{dev} (GPU {gpus[i]})" if dev.startswith("cuda") and i < len(gpus) else dev)
        return out

    def _engine_died(self, err: Exception) -> None:
        """The engine can never step again (a tensor-parallel rank died). In a Ray actor the
        process exits, so the worker is a dead worker to the ingress and the router (requests
        retried or UNAVAILABLE) and Ray restarts it with a fresh engine."""
        log.error("%s: %s; exiting so that Ray restarts this worker", self.worker_id, err)
        if _in_actor():
            for h in logging.getLogger("kvserve").handlers:
                h.flush()
            sys.stderr.flush()
            os._exit(1)

    def _report(self, state: str, load_s: float) -> None:
        log.info("%s: %s (device %s%s)", self.worker_id, state, self.config.resolved_device(),
                 f", {load_s:.1f} s" if load_s else "")
        if self._reporter is not None:  # fire and forget: start-up never waits on the router
            self._reporter.worker_state.remote(self.worker_id, self.incarnation, state, load_s)

    # ---- requests -------------------------------------------------------------------------
    @ray.method(_generator_backpressure_num_objects=STREAM_BACKPRESSURE)
    async def generate(
        self, request_id: str, prompt: list[int] | str, params: dict[str, Any],
        slot_id: str | None = None, lora: str | None = None, handoff: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream chunks {token_ids, text, finish_reason, usage, worker_id} or one {error}.

        `slot_id` is the router's name for this request's place in its in-flight count; the
        worker reports the slots it holds on `load`, so the router can drop stale ones.
        `lora`: the LoRA adapter to generate with (None: the base model).
        `handoff`: prefill only; after its first token the stream waits for the router to
        hand it to its decode worker (it ends here with {"moved_to": idx})."""
        self._ensure_metrics()
        track = self.metrics.request()
        try:
            sp = SamplingParams(**params)
        except ValueError as e:
            track.finish("error")
            yield {"error": "invalid", "message": str(e), "worker_id": self.worker_id}
            return
        if request_id in self._requests:
            track.finish("error")
            yield {"error": "invalid", "message": f"request id {request_id!r} is in use",
                   "worker_id": self.worker_id}
            return
        # the engine validates and tokenizes on the first step of this generator (in the pump)
        outs = self.engine.generate(prompt, sp, request_id, lora, handoff, self.handoff_lease_s)
        # closed with this generator: a consumer that leaves has its request aborted in the
        # engine before its close returns (a hand-off or move decided next sees it gone)
        async with aclosing(self._chunks(request_id, outs, slot_id, track)) as chunks:
            async for chunk in chunks:
                yield chunk

    @ray.method(_generator_backpressure_num_objects=STREAM_BACKPRESSURE)
    async def resume(
        self, request_id: str, slot_id: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a stream imported here, from where its previous worker stopped."""
        self._ensure_metrics()
        track = self.metrics.resumed()
        async with aclosing(self._chunks(request_id, self.engine.resume(request_id), slot_id,
                                         track)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _chunks(
        self, request_id: str, outs: AsyncIterator[RequestOutput], slot_id: str | None,
        track: RequestTracker,
    ) -> AsyncIterator[dict[str, Any]]:
        req = _Request(slot_id)
        self._requests[request_id] = req
        req.task = asyncio.create_task(self._pump(outs, req, track))
        sent_at: float | None = None  # when this stream's previous chunk went out
        try:
            while not req.aborted:
                await req.event.wait()
                req.event.clear()
                if req.outs and sent_at is not None:
                    await self._hold(req, sent_at)
                if req.outs:
                    chunk = req.take_chunk(self.worker_id)
                    if chunk["finish_reason"] is not None:
                        track.finish(chunk["finish_reason"])
                    yield chunk
                    sent_at = time.monotonic()
                    if chunk["finish_reason"] is not None:
                        self.served += 1
                        return
                if req.error is not None and req.outs:
                    req.event.set()  # outputs that arrived during the yield go first
                    continue
                if isinstance(req.error, StreamMoved):  # its consumer continues there
                    track.moved()
                    yield {"moved_to": req.error.target, "worker_id": self.worker_id}
                    return
                if req.error is not None:
                    bad = isinstance(req.error, InvalidRequestError | OutOfKVCacheError)
                    kind = ("invalid" if bad else "not_found" if isinstance(
                        req.error, NotFoundError) else "unavailable"
                        if isinstance(req.error, HandoffFailed) else "internal")
                    track.finish("error")
                    yield {"error": kind, "message": str(req.error), "worker_id": self.worker_id}
                    return
                if req.done and not req.outs:
                    return
        finally:
            # consumer gone (cancelled/closed) or finished: stop the pump, which aborts the
            # request in the engine and frees its KV if it was still running
            if self._requests.get(request_id) is req:  # a stream moved back may be here anew
                del self._requests[request_id]
            track.finish("abort")  # consumer gone before the end (no-op if it ended or moved)
            if not req.task.done():
                req.task.cancel()
                await asyncio.wait({req.task})  # its cleanup queues the engine's abort

    async def _hold(self, req: _Request, sent_at: float) -> None:
        """Let engine steps accumulate until the stream's pacing interval has passed."""
        deadline = sent_at + self.pacing.interval(len(self._requests))
        while not (req.done or req.outs[-1].finished):
            rest = deadline - time.monotonic()
            if rest <= 0:
                return
            req.event.clear()
            try:
                await asyncio.wait_for(req.event.wait(), rest)
            except TimeoutError:
                return

    async def _pump(
        self, gen: AsyncIterator[RequestOutput], req: _Request, track: RequestTracker
    ) -> None:
        try:
            async for out in gen:
                track.output(out)
                req.outs.append(out)
                req.event.set()
        except asyncio.CancelledError:
            await gen.aclose()
            raise
        except Exception as e:  # engine failure or late validation error
            req.error = e
        finally:
            req.done = True
            req.event.set()

    async def abort(self, request_id: str) -> bool:
        """Abort a request (its stream ends); KV blocks are freed by the engine."""
        req = self._requests.get(request_id)
        if req is None or req.task is None:
            self.engine.abort(request_id)  # imported and not resumed yet, or in transit
            return False
        req.aborted = True  # its stream ends too, even if the consumer never reads again
        req.task.cancel()
        req.event.set()
        return True

    # ---- load and info ----------------------------------------------------------------------
    async def load(self) -> dict[str, Any]:
        """What the router needs: queue, KV room, held prefix hashes, identity."""
        self._ensure_metrics()  # polled from the start, so a fresh worker exports at once
        s = self.engine.stats()
        parked = next((int(s[k]) for k in PARKED_KEYS if k in s), 0)
        return {
            "worker_id": self.worker_id,
            "incarnation": self.incarnation,
            "node_id": self.node_id,
            "running": int(s.get("running", 0)),
            "waiting": int(s.get("waiting", 0)),
            "parked": parked,
            "kv_blocks_free": int(s.get("kv_blocks_free", 0)),
            "kv_blocks_total": int(s.get("kv_blocks_total", 0)),
            "streams": len(self._requests),
            "slots": [r.slot_id for r in self._requests.values() if r.slot_id and not r.aborted],
            "parked_streams": self.engine.parked,
            "stream_list": self.engine.streams(),
            "held": self.engine.engine.held_block_hashes(),
            "stats": {k: float(v) for k, v in s.items() if isinstance(v, int | float)},
            "devices": self._devices,
            "runtime": self.engine.engine.runner.runtime,
            "ttft_recent": self.metrics.ttft_recent(),
            "loras": self._lora_view(),
            "role": self.role,
        }

    def _lora_view(self) -> dict[str, Any]:
        """Its LoRA adapters: names loaded, in device slots, in host memory."""
        ads = self.engine.engine.adapters
        if ads is None:
            return {"loaded": [], "device": [], "host": []}
        return {"loaded": list(ads.by_name), **ads.held()}

    # ---- LoRA adapters ----------------------------------------------------------------------
    async def add_lora(self, name: str, source: str) -> dict[str, Any]:
        """Load a LoRA adapter: its description, or {"error", "kind"} ("invalid": a bad
        adapter or a name taken by another one; nothing was kept)."""
        try:
            return await self.engine.add_lora(name, source)
        except InvalidRequestError as e:
            return {"error": str(e), "kind": "invalid"}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "kind": "internal"}

    def remove_lora(self, name: str) -> dict[str, Any]:
        """Unload a LoRA adapter ({"error", "kind": "not_found"} when it is not loaded)."""
        try:
            self.engine.remove_lora(name)
        except NotFoundError as e:
            return {"error": str(e), "kind": "not_found"}
        return {"removed": name}

    def list_loras(self) -> list[dict[str, Any]]:
        return self.engine.list_loras()

    def info(self) -> dict[str, Any]:
        eng = self.engine.engine
        return {
            "worker_id": self.worker_id,
            "incarnation": self.incarnation,
            "node_id": self.node_id,
            "max_model_len": eng.max_model_len,
            "vocab_size": eng.model_config.vocab_size,
            "block_size": self.config.block_size,
            "model_path": str(eng.model_path),
            "device": self.config.resolved_device(),
            "devices": self._devices,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "shard_pids": self.engine.engine.shard_pids(),
            "load_s": self.load_s,
            "loras": self.engine.list_loras(),
            "lora_enabled": self.engine.engine.adapters is not None,
            "role": self.role,
            # what another worker's KV must match to be exchanged with this one's
            "kv": {"model": model_geometry(eng),
                   "dtype": str(eng.runner.kv_dtype).removeprefix("torch."),
                   "block_size": eng.kv.block_size},
        }

    def set_role(self, role: str) -> str:
        """Change this worker's role (the router's `set_roles`: a run-time re-roling, for
        operators, benches and tests); returns the old one."""
        if role not in ROLES:
            raise ValueError(f"worker role {role!r} is not one of {', '.join(ROLES)}")
        old, self.role = self.role, role
        self.metrics.set_role(role)
        return old

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    # ---- holding the engine (fault drills, tests) -----------------------------------------------
    # Reached through the worker's Ray handle only (the router, operators, tests), like
    # `set_import_delay`: no client request can pause an engine.
    async def pause_engine(self) -> dict[str, Any]:
        """Hold the engine between steps (its streams keep their state; loads, moves and
        aborts are still served); returns the load as it is held."""
        await self.engine.pause()
        return await self.load()

    async def step_engine(self) -> dict[str, Any]:
        """Run one step of the held engine; returns the load after it."""
        await self.engine.step()
        return await self.load()

    def resume_engine(self) -> None:
        self.engine.unpause()

    # ---- metrics ------------------------------------------------------------------------------
    def _ensure_metrics(self) -> None:
        if self._metrics_task is None or self._metrics_task.done():
            self._metrics_task = asyncio.create_task(self._metrics_loop())

    async def ping(self) -> str:
        self._ensure_metrics()
        return self.incarnation

    def exported_metrics(self) -> list[str]:
        """Names of the Ray gauges this worker exports (one per numeric engine stat)."""
        return sorted(_metric_name(k) for k in self._gauges)

    async def _metrics_loop(self) -> None:
        from ray.util.metrics import Gauge

        while True:
            try:
                stats = self.engine.stats()
                self.metrics.poll(stats, len(self._requests))
                for key, value in stats.items():
                    if isinstance(value, bool) or not isinstance(value, int | float):
                        continue
                    g = self._gauges.get(key)
                    if g is None:  # new stat keys (e.g. the host tier's) appear automatically
                        g = Gauge(_metric_name(key), description=f"engine stat {key!r}",
                                  tag_keys=("worker",))
                        self._gauges[key] = g
                    g.set(float(value), tags={"worker": self.worker_id})
            except Exception:  # metrics must never take a worker down
                log.exception("exporting worker metrics failed")
            await asyncio.sleep(METRICS_PERIOD_S)


def _gpu_ids() -> list[str]:
    """The GPUs Ray gave this actor (none outside Ray or on CPU)."""
    if not ray.is_initialized():  # in-process: ray.get_gpu_ids() would start a Ray
        return []
    try:
        return [str(g) for g in ray.get_gpu_ids()]
    except Exception:
        return []


def _node_id() -> str:
    """The Ray node this process runs on ("" outside Ray: in-process tests)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def _in_actor() -> bool:
    """Whether this runs in a Ray actor (else in-process: tests, the bench's engine)."""
    return bool(ray.is_initialized() and ray.get_runtime_context().get_actor_id())


def _log_info_in_actor() -> None:
    """Ray leaves an actor's Python logging at WARNING: give kvserve's INFO lines (start-up
    progress, CUDA-graph captures) a handler, written to the worker's log (.err)."""
    if not _in_actor():
        return  # in-process (tests): the host's logging setup stays as it is
    kv = logging.getLogger("kvserve")
    if not kv.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        kv.addHandler(h)
        kv.setLevel(logging.INFO)
        kv.propagate = False


def create_worker(
    worker_id: str,
    engine_config: dict[str, Any],
    num_cpus: float = 1,
    num_gpus: float = 0,
    name: str | None = None,
    stream_interval_ms: float | None = None,
    model_name: str = "",
    reporter: Any = None,
    namespace: str | None = None,
    role: str = "mixed",
    handoff_lease_s: float = LEASE_S,
) -> Any:
    """Start a worker actor that Ray restarts (fresh engine) whenever it dies. This returns
    at once: Ray starts several workers' processes and model loads side by side. With
    `num_gpus` (a fraction lets workers share a GPU) Ray gives the actor its GPU through
    CUDA_VISIBLE_DEVICES, and the engine's device "cuda" is that GPU. A `name` (in
    `namespace`) stays the actor's across its restarts.

    A tensor-parallel worker (`tensor_parallel_size` > 1 in `engine_config`) first reserves
    its devices as one placement group packed on one node (`device_group`); the actor runs
    in it and starts its other ranks there. The group stays reserved while Ray restarts
    the actor; `stop_worker` frees it with the worker."""
    tp = int(engine_config.get("tensor_parallel_size") or 1)
    group = device_group(num_cpus, num_gpus, tp, name) if tp > 1 else None
    if group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts = worker_options(num_cpus, num_gpus, name,
                              PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0))
    else:
        opts = worker_options(num_cpus, num_gpus, name)
    if name and namespace:
        opts["namespace"] = namespace
    handle = ray.remote(WorkerActor).options(**opts).remote(
        worker_id, engine_config, stream_interval_ms, num_gpus > 0, model_name, reporter, role,
        handoff_lease_s)
    if group is not None:
        _DEVICE_GROUPS[handle._actor_id.hex()] = group
    return handle


# placement groups of the tensor-parallel workers this process created, by actor id
_DEVICE_GROUPS: dict[str, Any] = {}


def device_group(num_cpus: float, num_gpus: float, tensor_parallel_size: int,
                 name: str | None = None) -> Any:
    """A tensor-parallel worker's devices as one placement group on one node (STRICT_PACK):
    one bundle holding every rank's GPU (and the worker's CPUs), so the actor placed in it
    sees all of them (CUDA_VISIBLE_DEVICES) and gives rank r the r-th. Ray removes the group
    with its owner (the router) at the latest."""
    from ray.util.placement_group import placement_group

    if num_gpus and num_gpus != tensor_parallel_size:
        raise ValueError(f"a worker with tensor_parallel_size {tensor_parallel_size} needs one "
                         f"GPU per rank: num_gpus {num_gpus:g}")
    bundle = worker_bundle(num_cpus, num_gpus)
    if not bundle:
        raise ValueError("a tensor-parallel worker's placement group needs CPUs or GPUs to "
                         "reserve (num_cpus and num_gpus are both 0)")
    return placement_group([bundle], strategy="STRICT_PACK",
                           name=f"{name}-devices" if name else "")


def device_group_of(handle: Any) -> Any:
    """The placement group of a tensor-parallel worker this process created (else None)."""
    return _DEVICE_GROUPS.get(handle._actor_id.hex())


def stop_worker(handle: Any) -> None:
    """Stop a worker for good (no restart) and free its devices' placement group."""
    ray.kill(handle, no_restart=True)
    group = _DEVICE_GROUPS.pop(handle._actor_id.hex(), None)
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)


def worker_options(
    num_cpus: float, num_gpus: float, name: str | None = None,
    scheduling_strategy: Any = WORKER_PLACEMENT,
) -> dict[str, Any]:
    """The Ray actor options of a worker.

    Workers spread over the nodes with room for them (Ray's SPREAD), not packed onto the
    first: a node lost then takes as few workers as it can, and each worker gets its node's
    memory bandwidth to itself. A worker whose node died is restarted by the same rule on a
    node with room, or waits (restarting) until one joins. `scheduling_strategy` replaces
    the rule for a worker placed otherwise (e.g. in a placement group packed on one node)."""
    return {
        "name": name,
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "max_restarts": -1,
        "max_task_retries": 0,  # a half-served stream must not be replayed behind the client
        "max_concurrency": 1000,
        "scheduling_strategy": scheduling_strategy,
    }
