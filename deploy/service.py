"""Service: request validation, routing and streaming shared by the gRPC and HTTP front ends.

The ingress validates and tokenizes (so bad input never reaches a worker), asks the router
for a worker (one small actor call), starts the request there and reads its chunks from
the replica's one token stream with that worker (token_demux.py). A worker
that dies before the first token is retried on another one; after tokens were sent the
client gets UNAVAILABLE, told how many tokens it already has.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ObjectLostError, RayActorError

from kvserve.deploy.auth import key_matches
from kvserve.deploy.config import ServeConfig
from kvserve.deploy.errors import ServiceError
from kvserve.deploy.placement import check_placement
from kvserve.deploy.ray_endpoints import known_ray_endpoints
from kvserve.deploy.slots import Leases, Slot, outside_request
from kvserve.deploy.stream_relay import StreamRelay
from kvserve.deploy.token_demux import TokenDemux
from kvserve.errors import InvalidRequestError
from kvserve.kvcache.hashing import hash_full_blocks
from kvserve.kvcache.restore_cost import host_tier_summary
from kvserve.models import resolve_model
from kvserve.router.lifecycle import get_or_create_router
from kvserve.sampling import SamplingParams, parse_sampling_params
from kvserve.tools.parsers import for_template
from kvserve.tools.spec import ToolPlan
from kvserve.workers.loading.tokenizer import load_tokenizer
from kvserve.workers.structured.grammars import check_spec
from kvserve.workers.structured.vocab import marker_tokens

log = logging.getLogger(__name__)

VERSION = "0.1.0"
# a worker that dies (or whose stream's objects die with it) mid-request
WORKER_GONE = (RayActorError, ObjectLostError)
UNAVAILABLE_RETRY_S = 0.5  # how often a request waiting for the service to come back asks


@dataclass
class GenRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    lora: str | None = None  # the LoRA adapter it names (None: the base model)


@dataclass
class Result:
    """A whole (unary) answer."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | None
    usage: list[int]  # prompt, cached, completion
    worker_id: str
    logprobs: list[float] | None = None  # per token, when the request asked for them
    top_logprobs: list[list] | None = None  # per token: [[id, logprob], ...] best first
    prefill_worker_id: str = ""  # the worker that ran the prompt (worker_id unless handed off)


class Service:
    def __init__(self, cfg: ServeConfig, router: Any = None,
                 placement_checked: bool = False) -> None:
        self.cfg = cfg
        self.model_name = cfg.model_name()
        self.api_keys = frozenset(cfg.resolved_api_keys())
        # the tokenizer only: the weights are fetched by the workers, into their nodes' caches
        self.tokenizer = load_tokenizer(resolve_model(cfg.model, tokenizer_only=True))
        # the call format of the model's template (tool_choice auto)
        self.tool_parser = for_template(self.tokenizer.chat_template, marker_tokens(self.tokenizer))
        if router is None and not placement_checked:
            check_placement(cfg)  # workers no node can ever hold fail here, not in a silent wait
        self.router = router or get_or_create_router(cfg.router_config(), cfg.router_name)
        self.workers: list[Any] = []
        self.epoch = ""
        self.max_model_len = 0
        self.vocab_size = 0
        self.block_size = cfg.engine_config().block_size
        self.live: dict[str, Slot] = {}  # slot id -> slot, for requests being served here
        self.tokens = TokenDemux()  # this replica's token streams from the workers
        # requests moved to another worker after theirs died before a first token, and
        # picks that waited for a restarting router or worker (both shown in server info)
        self.retries = 0
        self.waits = 0
        # set when this replica stops its requests for good (the app shutting down past
        # its grace period): the message they end with
        self.stopping: str | None = None
        # LoRA adapters by name, as the router last listed them (their KV hash roots)
        self.loras: dict[str, dict[str, Any]] = {}
        # the other base models' names, where a service serves several: no adapter takes one
        self.other_models: frozenset[str] = frozenset()

    async def start(self) -> None:
        info = await self.router.ready.remote(self.cfg.wait_for_all_workers)
        await self._refresh_workers()
        await self._refresh_loras()
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info["vocab_size"])
        self.block_size = int(info["block_size"])

    # ---- checks -----------------------------------------------------------------------------
    def check_auth(self, key: str | None) -> None:
        if not self.api_keys:
            return
        if not key:
            raise ServiceError("unauthenticated", "missing API key (send 'authorization: Bearer KEY')")
        if not key_matches(key, self.api_keys):
            raise ServiceError("unauthenticated", "invalid API key")

    async def resolve_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model (also
        "default", or empty); NOT_FOUND for anything else. `base:adapter` (Ray Serve LLM's
        form) names the adapter too."""
        if not name or name in (self.model_name, "default"):
            return None
        lora = name
        base, sep, rest = name.partition(":")
        if sep and base in (self.model_name, "default") and rest:
            lora = rest
        if lora not in self.loras:  # loaded since (through another replica): ask the router
            await self._refresh_loras()
        if lora in self.loras:
            return lora
        served = [self.model_name, *self.loras]
        raise ServiceError("not_found", f"model {name!r} is not served here; available: "
                                        f"{', '.join(repr(m) for m in served)}")

    async def refresh_models(self) -> None:
        """The LoRA adapters as the router lists them now (for /v1/models, ListModels)."""
        await self._refresh_loras()

    async def _refresh_loras(self) -> None:
        try:
            listing = await self.router.list_loras.remote()
        except RayActorError:
            raise ServiceError("unavailable", "the router is restarting; retry shortly") from None
        self.loras = {d["name"]: d for d in listing}

    def models(self) -> list[dict[str, Any]]:
        """The base model and its LoRA adapters (each naming its parent), as last listed."""
        out = [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvserve",
                "root": self.cfg.model or self.model_name, "parent": None,
                "max_model_len": self.max_model_len}]
        for name, d in self.loras.items():
            out.append({"id": name, "object": "model", "created": int(d.get("created", 0)),
                        "owned_by": "kvserve", "root": d["source"], "parent": self.model_name,
                        "max_model_len": self.max_model_len, "lora_rank": d.get("rank", 0)})
        return out

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Load a LoRA adapter on every worker (all or none); ServiceError "invalid" for a
        bad adapter or name."""
        if not name or not isinstance(name, str) or ":" in name or name in (
                self.model_name, "default", *self.other_models):
            raise ServiceError("invalid", f"lora_name {name!r}: a LoRA adapter needs a name "
                                          "other than the base models', without ':'")
        if not path:
            raise ServiceError("invalid", "lora_path is required")
        res = await self._router_call("load_lora", name, path)
        if "error" in res:
            raise ServiceError(res.get("kind", "internal"), res["error"])
        self.loras[name] = res
        return res

    async def unload_lora(self, name: str) -> None:
        res = await self._router_call("unload_lora", name)
        self.loras.pop(name, None)
        if "error" in res:
            raise ServiceError(res.get("kind", "internal"), res["error"])

    async def _router_call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.router, method).remote(*args)
        except RayActorError:
            raise ServiceError("unavailable", "the router is restarting; retry shortly") from None

    # ---- request building -------------------------------------------------------------------
    def apply_tools(self, plan: ToolPlan | None, sampling: dict[str, Any]) -> None:
        """A forced tool call is the request's structured output; `auto` keeps the special
        tokens a call format may be marked with, and with a strict function its structured
        output is free text (or the response_format) and calls in the template's format."""
        if plan is None or not plan.returns_calls:
            return
        if plan.forced:
            if sampling.get("structured") is not None:
                raise ServiceError("invalid", "response_format cannot be combined with a "
                                              f"forced tool_choice ({plan.mode})")
            sampling["structured"] = plan.structured()
            return
        if self.tool_parser.needs_special_tokens:
            sampling["skip_special_tokens"] = False
        if plan.strict:
            answer = sampling.get("structured")
            try:
                if answer is not None:  # its own message names what is wrong with it
                    check_spec(answer)
                sampling["structured"] = plan.auto_structured(self.tool_parser, answer)
            except InvalidRequestError as e:
                raise ServiceError("invalid", str(e)) from None

    def tokenize(
        self, prompt: str | None = None, prompt_ids: list[int] | None = None,
        messages: list[Mapping[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a text prompt, token-id prompt or chat conversation (validated)."""
        try:
            if messages:
                msgs = [dict(m) for m in messages]
                for m in msgs:
                    if not isinstance(m.get("role"), str) or not m["role"]:
                        raise InvalidRequestError("every message needs a non-empty 'role'")
                return list(self.tokenizer.apply_chat_template(msgs, tokenize=True, tools=tools))
            if prompt_ids:
                bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise InvalidRequestError(
                        f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
                    )
                return list(prompt_ids)
            if prompt:
                if _has_surrogates(prompt):  # undecodable bytes smuggled in as surrogates
                    raise InvalidRequestError("prompt is not valid UTF-8")
                return self.tokenizer.encode(prompt)
        except InvalidRequestError as e:
            raise ServiceError("invalid", str(e)) from None
        except Exception as e:  # e.g. a template error on malformed messages
            raise ServiceError("invalid", f"cannot tokenize the input: {e}") from None
        raise ServiceError("invalid", "prompt is empty" if messages is None else "messages are empty")

    def build(
        self,
        prompt_ids: list[int],
        sampling: Mapping[str, Any] | None,
        session_id: str | None = None,
        request_id: str | None = None,
        default_max_tokens: int | None = None,
        lora: str | None = None,
    ) -> GenRequest:
        """Validate sampling parameters and lengths against the context."""
        sampling = dict(sampling or {})
        for k, v in sampling.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise ServiceError("invalid", f"invalid sampling parameters: {k} must be finite (got {v})")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise ServiceError(
                "invalid",
                f"prompt has {n} tokens; the context is {self.max_model_len} tokens "
                "(max_model_len) and at least one must be left for the output",
            )
        if sampling.get("max_tokens") is None:
            sampling["max_tokens"] = default_max_tokens or (self.max_model_len - n)
        try:
            params = parse_sampling_params(sampling)
            if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
                raise InvalidRequestError(
                    f"logit_bias names token {max(params.logit_bias)}, outside the vocabulary "
                    f"(0..{self.vocab_size - 1})")
            if params.structured is not None:  # a bad schema is refused here, not on a worker
                check_spec(params.structured)
        except InvalidRequestError as e:
            raise ServiceError("invalid", str(e)) from None
        if n + params.max_tokens > self.max_model_len:
            raise ServiceError(
                "invalid",
                f"max_tokens={params.max_tokens} plus the prompt's {n} tokens is "
                f"{n + params.max_tokens}, more than the context of {self.max_model_len} tokens "
                "(max_model_len)",
            )
        rid = request_id or f"req-{uuid.uuid4().hex}"
        return GenRequest(rid, prompt_ids, params, session_id or None, lora)

    # ---- serving ----------------------------------------------------------------------------
    async def stream(
        self, req: GenRequest, leases: Leases | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Chunks from the chosen worker; raises ServiceError on failure.

        Each attempt's router slot is released in this generator's `finally` and, when the
        caller passes `leases`, also when the caller closes them (whichever comes first)."""
        # an adapter's KV chains from its own root: affinity finds only its blocks
        root = int(self.loras.get(req.lora, {}).get("root", 0)) if req.lora else 0
        hashes = hash_full_blocks(req.prompt_ids, self.block_size, parent=root)
        tried: list[int] = []
        params = req.params.model_dump()
        for _attempt in range(self.cfg.max_retries + 1):
            slot = await self._pick(hashes, req, tried, leases)
            if slot is None:  # every worker left has failed this request
                break
            sent = 0
            try:
                if slot.epoch != self.epoch or slot.idx >= len(self.workers):
                    # the router was restarted with new workers, or started more: their
                    # handles (the chosen worker is ready; new ones still loading are not
                    # waited for)
                    await self._refresh_workers()
                # follows the request when the router moves its stream to another worker
                relay = StreamRelay(self.workers, slot.idx, req.request_id,
                                    lambda src, dst, s=slot: self._moved(s, src, dst), slot.slot_id,
                                    self.tokens, handoff=slot.handoff_to is not None)
                slot.worker = relay.worker
                async for chunk in relay.chunks(req.prompt_ids, params, req.lora):
                    if "error" in chunk:
                        slot.finished = True
                        raise ServiceError(chunk["error"], chunk["message"])
                    # where the prompt ran and where the stream decodes (response headers)
                    chunk["prefill_worker_id"] = slot.prefill_worker_id
                    chunk["decode_worker_id"] = slot.decode_worker_id
                    sent += len(chunk["token_ids"])
                    slot.finished = chunk["finish_reason"] is not None
                    yield chunk
                if not slot.finished:
                    if self.stopping:
                        raise ServiceError("unavailable", self.stopping)
                    raise ServiceError("internal", f"worker {slot.worker_id} ended the stream early")
                return
            except WORKER_GONE as e:
                slot.finished = True  # nothing left to abort on a dead worker
                self.router.report_failure.remote(slot.idx)
                if sent == 0:
                    log.warning("worker %s died before the first token of %s; retrying: %s",
                                slot.worker_id, req.request_id, e)
                    tried.append(slot.idx)
                    self.retries += 1
                    continue
                raise ServiceError(
                    "unavailable",
                    f"worker {slot.worker_id} died mid-stream after {sent} tokens were sent; "
                    "retry the request",
                ) from None
            finally:
                slot.release()  # aborts on the worker too if it did not finish
        raise ServiceError("unavailable", "no worker could take the request (workers died)")

    async def _refresh_workers(self) -> None:
        """The router's worker handles, updated in place: relays under way see new ones."""
        epoch, workers = await self.router.workers_with_epoch.remote()
        if epoch != self.epoch:  # a new router: its workers are new ones
            self.tokens.forget()
        self.epoch = epoch
        self.workers[:] = workers

    async def _moved(self, slot: Slot, src: int, dst: int) -> None:
        """The router moved the request's stream: its slot, release and abort follow it."""
        # not a child of the request: a cancellation now must not drop the move (then the
        # release, sent the same way, would find the slot on the wrong worker)
        outside_request().run(self.router.move_slot.remote, src, dst, slot.slot_id)
        if dst >= len(self.workers):  # a worker the router started since this replica looked
            _, workers = await self.router.workers_with_epoch.remote()
            self.workers[:] = workers
        slot.idx, slot.worker_id, slot.worker = dst, f"worker-{dst}", self.workers[dst]

    def stop_requests(self, message: str) -> int:
        """End every request this replica serves with UNAVAILABLE / 503 `message` (the app
        is going away and its grace period is over); returns how many were running."""
        self.stopping = message
        slots = [s for s in self.live.values() if not s.finished and s.worker is not None]
        for s in slots:
            outside_request().run(s.worker.abort.remote, s.request_id)
        return len(slots)

    async def _pick(
        self, hashes: list[int], req: GenRequest, tried: list[int], leases: Leases | None
    ) -> Slot | None:
        """A slot on a worker, None when only failed workers are left; ServiceError otherwise.

        While the router restarts, or no worker is up (a restart under way), it asks again
        for up to `unavailable_wait_s`: a request that has no token yet waits for the
        service to come back rather than failing. An autoscaled pool with no worker serving
        holds the pick in the router's queue while one starts; its refusal (with a retry
        time) is final."""
        deadline = time.monotonic() + self.cfg.unavailable_wait_s
        while True:
            try:
                slot = await self._pick_once(hashes, req, tried, leases)
            except ServiceError as e:
                if (e.kind != "unavailable" or e.retry_after is not None
                        or time.monotonic() >= deadline):
                    raise
            else:
                if slot is not None or time.monotonic() >= deadline:
                    return slot
                tried.clear()  # every worker failed it: the restarted ones may take it now
            self.waits += 1
            await asyncio.sleep(UNAVAILABLE_RETRY_S)

    async def _pick_once(
        self, hashes: list[int], req: GenRequest, tried: list[int], leases: Leases | None
    ) -> Slot | None:
        async def call() -> dict:
            return await self.router.pick.remote(hashes, req.session_id, tried, req.request_id,
                                                 req.lora, len(req.prompt_ids),
                                                 req.params.max_tokens)

        # Shielded: a caller cancelled mid-pick (client gone, a sibling choice failed) must
        # still give back the slot the router counts for it, or the count leaks for good.
        # Submitted outside the request's Ray task, so Ray's recursive cancellation of a
        # cancelled request cannot fail a pick the router has already counted.
        task = asyncio.get_running_loop().create_task(call(), context=outside_request())
        try:
            pick = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._release_unused, context=outside_request())
            raise
        except RayActorError:  # the router is restarting (Ray brings it back)
            raise ServiceError("unavailable", "the router is restarting; retry shortly") from None
        if "error" in pick:
            if tried and pick["error"] == "unavailable":
                return None
            if pick["error"] == "not_found":  # an adapter unloaded since this replica looked
                self.loras.pop(req.lora or "", None)
            raise ServiceError(pick["error"], pick["message"], pick.get("retry_after"))
        # no await from the pick's answer to here: the slot is registered before any cancel
        slot = Slot(self.router, pick, req.request_id, self.live)
        if leases is not None:
            leases.add(slot)
        return slot

    def _release_unused(self, task: asyncio.Future) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        if "idx" in (pick := task.result()):  # a worker was counted for us
            self.router.release.remote(pick["idx"], pick["slot_id"])

    async def complete(self, req: GenRequest, leases: Leases | None = None) -> Result:
        text, ids, last = [], [], None
        lps: list[float] | None = [] if req.params.logprobs is not None else None
        tops: list[list] | None = [] if req.params.logprobs else None
        async for chunk in self.stream(req, leases):
            text.append(chunk["text"])
            ids.extend(chunk["token_ids"])
            if lps is not None:
                lps.extend(chunk.get("logprobs") or ())
            if tops is not None:
                tops.extend(chunk.get("top_logprobs") or ())
            last = chunk
        assert last is not None
        return Result(req.request_id, "".join(text), ids, last["finish_reason"],
                      last["stop_reason"], last["usage"], last["worker_id"], lps, tops,
                      last.get("prefill_worker_id", last["worker_id"]))

    def token_text(self, token_id: int) -> str:
        """A token's text on its own (for logprobs), special tokens included."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def server_info(self) -> dict[str, Any]:
        try:
            info = await self.router.server_info.remote()
        except RayActorError:
            raise ServiceError("unavailable", "the router is restarting; retry shortly") from None
        policy = self.cfg.engine_config().host_restore_policy
        for w in info["workers"]:
            w["host_tier"] = host_tier_summary(w.get("stats", {}), policy)
        # this ingress replica's own view: slots it holds for requests it is serving
        info["ingress"] = {"slots": len(self.live), "retries": self.retries,
                           "pick_waits": self.waits, **self.tokens.info()}
        ray_ep = await asyncio.to_thread(known_ray_endpoints)
        info["ray"] = {"dashboard_url": ray_ep.dashboard_url, "metrics_port": ray_ep.metrics_port}
        info["max_model_len"] = self.max_model_len
        self.loras = {d["name"]: d for d in info.get("loras", [])}
        return info


def _has_surrogates(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def sampling_from_fields(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The sampling fields a client set (unset ones keep the engine defaults)."""
    return {n: getattr(obj, n) for n in names if getattr(obj, n, None) is not None}
