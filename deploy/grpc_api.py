"""The kvserve.v1.KVServe gRPC methods, as a mixin of the Serve ingress deployment.

Serve's gRPC proxy calls the ingress method named like the RPC. Errors set the status code
and details on the gRPC context, then raise, which Serve turns into that status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from kvserve.deploy import admin, metrics
from kvserve.deploy.base_models import BaseModels
from kvserve.deploy.errors import ServiceError, for_model
from kvserve.deploy.grpc_servicer import INVALID_UTF8_MARKER
from kvserve.deploy.service import GenRequest, Service
from kvserve.deploy.slots import Leases
from kvserve.errors import InvalidRequestError
from kvserve.protos import kvserve_pb2 as pb
from kvserve.structured import from_response_format
from kvserve.tools.calls import ToolStream, extract
from kvserve.tools.spec import ToolPlan, parse_tools

_OPTIONAL = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "seed", "logprobs",
             "skip_special_tokens", "min_tokens")
_PLAIN = ("ignore_eos", "include_stop_str_in_output")


def sampling_dict(sp: pb.SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(sp, k) for k in _OPTIONAL if sp.HasField(k)}
    out.update({k: True for k in _PLAIN if getattr(sp, k)})
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        out["logit_bias"] = dict(sp.logit_bias)
    if sp.HasField("response_format"):
        try:
            structured = from_response_format(_response_format(sp.response_format))
        except InvalidRequestError as e:
            raise ServiceError("invalid", str(e).replace("response_format", "sampling.response_format")) \
                from None
        if structured is not None:
            out["structured"] = structured
    return out


def _response_format(rf: pb.ResponseFormat) -> dict[str, Any] | None:
    """The message as OpenAI's response_format object (one validation for both APIs)."""
    which = rf.WhichOneof("format")
    if which == "json_object":
        return {"type": "json_object"}
    if which == "json_schema":
        js = rf.json_schema
        return {"type": "json_schema",
                "json_schema": {"name": js.name, "schema": js.schema, "strict": js.strict}}
    if which == "regex":
        return {"type": "regex", "regex": rf.regex}
    if which == "grammar":
        return {"type": "grammar", "grammar": rf.grammar}
    return None


def _tool_plan(request: pb.ChatRequest) -> ToolPlan | None:
    tools = [{"type": "function", "function": {
        "name": t.function.name, "description": t.function.description,
        "parameters": t.function.parameters or None, "strict": t.function.strict}}
        for t in request.tools]
    choice: Any = None
    if request.HasField("tool_choice"):
        which = request.tool_choice.WhichOneof("choice")
        if which == "mode":
            choice = request.tool_choice.mode
        elif which == "function_name":
            choice = {"type": "function", "function": {"name": request.tool_choice.function_name}}
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
    try:
        return parse_tools(tools, choice, parallel)
    except InvalidRequestError as e:
        raise ServiceError("invalid", str(e)) from None


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
        out["content"] = m.content or None
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _calls_finish(reason: str, calls: bool) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


def _api_key(ctx: Any) -> str | None:
    md = dict(ctx.invocation_metadata() or ())
    auth = md.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return md.get("x-api-key") or (auth or None)


def _usage(u: list[int]) -> pb.Usage:
    return pb.Usage(prompt_tokens=u[0], cached_tokens=u[1], completion_tokens=u[2])


def _logprobs(
    svc: Service, ids: list[int], lps: list[float] | None, tops: list[list] | None
) -> list[pb.TokenLogprob]:
    if lps is None:
        return []
    return [
        pb.TokenLogprob(
            token_id=t, logprob=lp, token=svc.token_text(t),
            top_logprobs=[pb.TopLogprob(token_id=a, logprob=b, token=svc.token_text(a))
                          for a, b in (tops[i] if tops else ())],
        )
        for i, (t, lp) in enumerate(zip(ids, lps, strict=True))
    ]


def _stream_response(
    svc: Service, req: GenRequest, c: dict[str, Any], tools: ToolStream | None = None
) -> pb.GenerateStreamResponse:
    text, finish, deltas = c["text"], c["finish_reason"] or "", []
    if tools is not None:  # content and tool-call deltas, as the HTTP API streams them
        text, deltas = tools.feed(text)
        if finish:
            more, late = tools.finish()
            text, deltas = text + more, deltas + late
            finish = _calls_finish(finish, bool(tools.calls))
    return pb.GenerateStreamResponse(
        request_id=req.request_id, delta_text=text, delta_token_ids=c["token_ids"],
        finish_reason=finish, stop_reason=c["stop_reason"] or "",
        usage=_usage(c["usage"]), worker_id=c["worker_id"], model=req.lora or svc.model_name,
        logprobs=_logprobs(svc, c["token_ids"], c.get("logprobs"), c.get("top_logprobs")),
        tool_calls=[pb.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "",
                                     arguments=d.arguments) for d in deltas],
        prefill_worker_id=c.get("prefill_worker_id", c["worker_id"]),
    )


def autoscaling_info(a: dict[str, Any] | None) -> pb.AutoscalingInfo | None:
    """The router's autoscaling block as the proto message."""
    if not a:
        return None
    pending = a.get("pending") or {}
    return pb.AutoscalingInfo(
        enabled=a["enabled"], min_workers=a["min_workers"], max_workers=a["max_workers"],
        desired_workers=a["desired_workers"], serving_workers=a["serving_workers"],
        starting_workers=a["starting_workers"], draining_workers=a["draining_workers"],
        queued_requests=a["queued_requests"], reason=a["reason"], detail=a["detail"],
        pending_direction=pending.get("direction", ""), pending_in_s=pending.get("in_s", 0.0),
        signals=a["signals"], decisions=a["decisions"],
        cold_starts=[pb.ColdStart(worker_id=c["worker_id"], reason=c["reason"],
                                  cold_start_s=c["cold_start_s"],
                                  pressure_to_serving_s=c["pressure_to_serving_s"],
                                  load_seconds=c["load_s"]) for c in a["cold_starts"]],
        upscale_delay_s=a["upscale_delay_s"], downscale_delay_s=a["downscale_delay_s"])


async def _check_model(models: BaseModels, request: Any) -> tuple[Service, str | None]:
    """The base model's Service the request's `model` names, and the LoRA adapter (None:
    the base model)."""
    if request.model == INVALID_UTF8_MARKER:
        raise ServiceError("invalid", "the request could not be parsed: a string field is not "
                                      "valid UTF-8 (or the message is malformed)")
    return await models.pick(request.model)


def _workers(workers: list[dict[str, Any]]) -> list[pb.WorkerInfo]:
    return [
        pb.WorkerInfo(
            worker_id=w["worker_id"], alive=w["alive"], running=w["running"],
            waiting=w["waiting"], parked=w["parked"], free_device_blocks=w["kv_blocks_free"],
            total_device_blocks=w["kv_blocks_total"],
            held_device_blocks=w["held_device_blocks"], held_host_blocks=w["held_host_blocks"],
            restarts=w["restarts"], stats=w["stats"], inflight=w["inflight"],
            reconciled_slots=w["reconciled_slots"], state=w["state"],
            load_seconds=w["load_s"], host_tier=pb.HostTierInfo(**w["host_tier"]),
            tensor_parallel_size=w["tensor_parallel_size"], devices=w["devices"],
            runtime=w.get("runtime", {}),
            streams=[pb.StreamInfo(request_id=s["request_id"], state=s["state"],
                                   tokens=s["tokens"], kv_blocks=s["blocks"])
                     for s in w.get("streams", [])],
            lora_device=w.get("loras", {}).get("device", []),
            lora_host=w.get("loras", {}).get("host", []),
            role=w.get("role", "mixed"),
        )
        for w in workers
    ]


def _fail(ctx: Any, e: ServiceError) -> ServiceError:
    metrics.rejected(e)
    ctx.set_code(e.grpc_code)
    ctx.set_details(e.message)
    return e


class GrpcFrontend:
    service: Service  # the first base model's
    models: BaseModels  # every base model's

    def _authed(self, ctx: Any) -> Service:
        """The service, once the caller's API key checks out (ServiceError otherwise)."""
        self.service.check_auth(_api_key(ctx))
        return self.service

    async def _gen_request(
        self, request: Any, ctx: Any, chat: bool
    ) -> tuple[Service, GenRequest, ToolPlan | None]:
        """The model's Service, the request, and its tools when its answer may hold calls."""
        self._authed(ctx)
        svc, lora = await _check_model(self.models, request)
        with for_model(svc.model_name):
            return svc, *self._build(svc, lora, request, chat)

    def _build(self, svc: Service, lora: str | None, request: Any,
               chat: bool) -> tuple[GenRequest, ToolPlan | None]:
        if (size := request.ByteSize()) > svc.cfg.max_request_bytes:
            raise ServiceError("too_large", f"request message has {size} bytes; the server's "
                                            f"limit is {svc.cfg.max_request_bytes} (max_request_bytes)")
        sampling = sampling_dict(request.sampling)
        plan = None
        if chat:
            msgs = [_message(m) for m in request.messages]
            if not msgs:
                raise ServiceError("invalid", "messages are empty")
            plan = _tool_plan(request)
            svc.apply_tools(plan, sampling)
            ids = svc.tokenize(messages=msgs, tools=plan.tools() if plan else None)
        else:
            ids = svc.tokenize(prompt=request.prompt, prompt_ids=list(request.prompt_token_ids))
        session = request.session_id if request.HasField("session_id") else None
        req = svc.build(ids, sampling, session, request.request_id or None, default_max_tokens=16,
                        lora=lora)
        return req, plan if plan is not None and plan.returns_calls else None

    async def _unary(self, request: Any, ctx: Any, chat: bool) -> pb.GenerateResponse:
        leases = Leases()  # the request's router slots, released however the call ends
        try:
            svc, req, plan = await self._gen_request(request, ctx, chat)
            with for_model(svc.model_name):
                r = await svc.complete(req, leases)
        except ServiceError as e:
            raise _fail(ctx, e) from None
        finally:
            leases.close()
        text, calls = r.text, []
        if plan is not None:
            text, calls = extract(r.text, plan.forced, svc.tool_parser)
        return pb.GenerateResponse(
            request_id=r.request_id, text=text, token_ids=r.token_ids,
            finish_reason=_calls_finish(r.finish_reason, bool(calls)),
            stop_reason=r.stop_reason or "", usage=_usage(r.usage),
            worker_id=r.worker_id, model=req.lora or svc.model_name,
            logprobs=_logprobs(svc, r.token_ids, r.logprobs, r.top_logprobs),
            tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls],
            prefill_worker_id=r.prefill_worker_id or r.worker_id,
        )

    async def _stream(
        self, request: Any, ctx: Any, chat: bool
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        leases = Leases()  # released however the call ends (Serve cancels it on a client cancel)
        try:
            svc, req, plan = await self._gen_request(request, ctx, chat)
            tools = None if plan is None else ToolStream(plan.forced, svc.tool_parser)
            with for_model(svc.model_name):
                async with aclosing(svc.stream(req, leases)) as chunks:
                    async for c in chunks:
                        yield _stream_response(svc, req, c, tools)
        except ServiceError as e:
            raise _fail(ctx, e) from None
        finally:
            leases.close()

    # ---- RPCs (names as in kvserve.proto) ------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, grpc_context: Any) -> pb.GenerateResponse:
        return await self._unary(request, grpc_context, chat=False)

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: Any
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with aclosing(self._stream(request, grpc_context, chat=False)) as rs:
            async for r in rs:
                yield r

    async def Chat(self, request: pb.ChatRequest, grpc_context: Any) -> pb.GenerateResponse:
        return await self._unary(request, grpc_context, chat=True)

    async def ChatStream(
        self, request: pb.ChatRequest, grpc_context: Any
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with aclosing(self._stream(request, grpc_context, chat=True)) as rs:
            async for r in rs:
                yield r

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context: Any) -> pb.TokenizeResponse:
        try:
            self._authed(grpc_context)
            svc, _ = await _check_model(self.models, request)
            msgs = [{"role": m.role, "content": m.content} for m in request.messages]
            ids = svc.tokenize(prompt=request.prompt, messages=msgs or None)
        except ServiceError as e:
            raise _fail(grpc_context, e) from None
        return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=svc.max_model_len)

    async def ListModels(
        self, request: pb.ListModelsRequest, grpc_context: Any
    ) -> pb.ListModelsResponse:
        try:
            self._authed(grpc_context)
            await self.models.refresh_models()
        except ServiceError as e:
            raise _fail(grpc_context, e) from None
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            id=m["id"], max_model_len=m["max_model_len"], owned_by=m["owned_by"],
            parent=m["parent"] or "", root=m["root"], lora_rank=m.get("lora_rank", 0))
            for m in self.models.models()])

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, grpc_context: Any
    ) -> pb.GetServerInfoResponse:
        try:
            svc = self._authed(grpc_context)
        except ServiceError as e:
            raise _fail(grpc_context, e) from None
        info = await self.models.server_info()
        return pb.GetServerInfoResponse(
            version="0.1.0", model=svc.model_name, workers=_workers(info["workers"]),
            routing_policy=info["routing_policy"], metrics_port=info["ray"]["metrics_port"],
            dashboard_url=info["ray"]["dashboard_url"], max_model_len=svc.max_model_len,
            autoscaling=autoscaling_info(info.get("autoscaling")),
            models=[pb.ModelServerInfo(
                model=m["model"], root=m["root"], max_model_len=m["max_model_len"],
                routing_policy=m["routing_policy"], workers=_workers(m["workers"]),
                autoscaling=autoscaling_info(m.get("autoscaling")),
                loras=[lo["name"] for lo in m["loras"]]) for m in info["models"]])

    async def MoveStream(
        self, request: pb.MoveStreamRequest, grpc_context: Any
    ) -> pb.MoveStreamResponse:
        try:
            self._authed(grpc_context)
            svc = self.models.base(request.model)
            res = await admin.move(svc, request.request_id, request.worker_id,
                                   request.stop_and_copy)
        except ServiceError as e:
            raise _fail(grpc_context, e) from None
        return pb.MoveStreamResponse(**res)

    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, grpc_context: Any
    ) -> pb.LoadLoraAdapterResponse:
        try:
            svc = self._authed(grpc_context)
            res = await svc.load_lora(request.lora_name, request.lora_path)
        except ServiceError as e:
            raise _fail(grpc_context, e) from None
        return pb.LoadLoraAdapterResponse(lora_name=res["name"], rank=res["rank"],
                                          modules=res["modules"])

    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, grpc_context: Any
    ) -> pb.UnloadLoraAdapterResponse:
        try:
            svc = self._authed(grpc_context)
            await svc.unload_lora(request.lora_name)
        except ServiceError as e:
            raise _fail(grpc_context, e) from None
        return pb.UnloadLoraAdapterResponse(lora_name=request.lora_name)

    async def DrainWorker(
        self, request: pb.DrainWorkerRequest, grpc_context: Any
    ) -> pb.DrainWorkerResponse:
        try:
            self._authed(grpc_context)
            svc = self.models.base(request.model)
            timeout = request.timeout_s if request.HasField("timeout_s") else None
            res = await admin.drain(svc, request.worker_id, timeout)
        except ServiceError as e:
            raise _fail(grpc_context, e) from None
        return pb.DrainWorkerResponse(worker_id=res["worker_id"],
                                      streams_moved=res["streams_moved"], drained=res["drained"],
                                      sessions_moved=res["sessions_moved"])
