"""OpenAI-compatible HTTP API: request models, response bodies and SSE streaming.

Request fields are parsed by pydantic here; sampling fields then go through the engine's
own SamplingParams validation (the same models as gRPC), so both front ends accept and
reject exactly the same values.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from kvserve.deploy.errors import ServiceError
from kvserve.deploy.openai_choices import complete_all, fan_out, num_choices, stream_all
from kvserve.deploy.service import GenRequest, Service, sampling_from_fields
from kvserve.deploy.slots import Leases
from kvserve.errors import InvalidRequestError
from kvserve.structured import from_response_format
from kvserve.tools.calls import ToolStream, extract
from kvserve.tools.spec import ToolPlan, parse_tools

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "min_tokens", "include_stop_str_in_output",
                   "skip_special_tokens")


# OpenAI fields kvserve knows but cannot honour: a request that sets one (to anything but
# the value that asks for nothing) is refused rather than silently served without it.
_UNHONOURED: dict[str, tuple[Any, ...]] = {
    "audio": (None,), "prediction": (None,), "web_search_options": (None,),
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "store": (None, False), "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "guided_json": (None,), "guided_regex": (None,),
    "guided_grammar": (None,), "guided_choice": (None,),
}
_WHY = {
    "functions": "use tools and tool_choice", "function_call": "use tools and tool_choice",
    "guided_json": "use response_format json_schema",
    "guided_regex": "use response_format {'type': 'regex', 'regex': ...}",
    "guided_grammar": "use response_format {'type': 'grammar', 'grammar': ...}",
}


class _SamplingFields(BaseModel):
    # Unknown OpenAI fields (user, metadata...) are ignored as OpenAI-compatible servers do;
    # known ones kvserve cannot honour are refused (`check_unhonoured`). NaN/inf pass here
    # and are rejected with a clear message by the sampling validation.
    model_config = ConfigDict(extra="allow", allow_inf_nan=True, protected_namespaces=())

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    n: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    session_id: str | None = Field(None, description="kvserve extension: multi-turn affinity")
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    # json_object, json_schema; kvserve's regex and grammar (docs/serving.md)
    response_format: dict[str, Any] | None = None

    def check_unhonoured(self) -> None:
        extra = self.model_extra or {}
        for name, fine in _UNHONOURED.items():
            if name in extra and extra[name] not in fine and not (
                    name == "best_of" and extra[name] == self.n):
                why = _WHY.get(name, "kvserve does not support it")
                raise ServiceError("invalid", f"{name}={extra[name]!r} cannot be honoured: {why}")

    def sampling_extras(self) -> dict[str, Any]:
        """max_completion_tokens, logit_bias and response_format as sampling fields."""
        out: dict[str, Any] = {}
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ServiceError("invalid", "max_tokens and max_completion_tokens disagree "
                                              f"({self.max_tokens} vs {self.max_completion_tokens})")
            out["max_tokens"] = self.max_completion_tokens
        if self.logit_bias:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = v
                except ValueError:
                    raise ServiceError("invalid", f"logit_bias keys must be token ids, got {k!r}") \
                        from None
            out["logit_bias"] = bias
        try:
            structured = from_response_format(self.response_format)
        except InvalidRequestError as e:
            raise ServiceError("invalid", str(e)) from None
        if structured is not None:
            out["structured"] = structured
        return out

    def num_logprobs(self, kind: str) -> int | None:
        """The engine's `logprobs` (alternatives per token) for this request; None = none.

        Completions take `logprobs: N` (legacy API); chat takes `logprobs: true` plus
        `top_logprobs: N`, as OpenAI's API does.
        """
        if kind == "completion":
            return None if self.logprobs in (None, False) else int(self.logprobs)
        if not self.logprobs:
            if self.top_logprobs not in (None, 0):
                raise ServiceError("invalid", "top_logprobs requires logprobs: true")
            return None
        return self.top_logprobs or 0

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
            if self.content is None:
                m["content"] = None
        for k in ("tool_call_id", "name"):
            if getattr(self, k) is not None:
                m[k] = getattr(self, k)
        return m


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    _plan: ToolPlan | None = PrivateAttr(None)


def error_response(e: ServiceError) -> JSONResponse:
    return JSONResponse(e.openai_body(), status_code=e.http_status, headers=e.headers())


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return error_response(ServiceError("invalid", "invalid request: " + "; ".join(parts)))


def _usage(u: list[int]) -> dict[str, Any]:
    return {"prompt_tokens": u[0], "completion_tokens": u[2], "total_tokens": u[0] + u[2],
            "prompt_tokens_details": {"cached_tokens": u[1]}}


def _sampling(body: _SamplingFields, kind: str) -> dict[str, Any]:
    num_choices(body.n)  # `n` is the front end's (openai_choices.py), checked up front
    body.check_unhonoured()
    sampling = sampling_from_fields(body, SAMPLING_FIELDS) | body.sampling_extras()
    n = body.num_logprobs(kind)
    if n is not None:
        sampling["logprobs"] = n
    return sampling


def completion_request(svc: Service, body: CompletionRequest, lora: str | None = None) -> GenRequest:
    """`lora`: the adapter `body.model` names (`Service.resolve_model`)."""
    p = body.prompt
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise ServiceError("invalid", "only one prompt per request is supported")
        p = p[0]
    ids = svc.tokenize(prompt=p) if isinstance(p, str) else svc.tokenize(prompt_ids=list(p))
    return svc.build(ids, _sampling(body, "completion"), body.session_id, default_max_tokens=16,
                     lora=lora)


def chat_request(svc: Service, body: ChatRequest, lora: str | None = None) -> GenRequest:
    if not body.messages:
        raise ServiceError("invalid", "messages are empty")
    sampling = _sampling(body, "chat")
    try:
        plan = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    except InvalidRequestError as e:
        raise ServiceError("invalid", str(e)) from None
    svc.apply_tools(plan, sampling)
    body._plan = plan
    ids = svc.tokenize(messages=[m.for_template() for m in body.messages],
                       tools=plan.tools() if plan else None)
    return svc.build(ids, sampling, body.session_id, lora=lora)


class LoadLoraRequest(BaseModel):
    """Body of POST /v1/load_lora_adapter (vLLM's)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter loaded under the name


class UnloadLoraRequest(BaseModel):
    """Body of POST /v1/unload_lora_adapter (vLLM's; `lora_int_id` is accepted, unused)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


async def respond(
    svc: Service, req: GenRequest, body: _SamplingFields, kind: Literal["completion", "chat"]
) -> Any:
    """A JSON body, or an SSE stream whose first chunk already arrived (so routing errors
    are still real HTTP statuses). `n` > 1 runs that many requests, one per choice."""
    created = int(time.time())
    rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + req.request_id
    reqs = fan_out(req, num_choices(body.n))
    leases = Leases()  # every router slot of this request, released when it ends
    if not body.stream:
        try:
            results = await complete_all(svc, reqs, leases)
        finally:
            leases.close()
        lps = _Logprobs(svc, kind)
        plan = _plan(body)
        choices = []
        for i, r in enumerate(results):
            choice: dict[str, Any] = {"index": i, "finish_reason": r.finish_reason,
                                      "logprobs": lps.of(r.token_ids, r.logprobs, r.top_logprobs)}
            if kind == "completion":
                choice["text"] = r.text
            elif plan is not None:
                content, calls = extract(r.text, plan.forced, svc.tool_parser)
                choice["message"] = {"role": "assistant", "content": content or None}
                if calls:
                    choice["message"]["tool_calls"] = [
                        {"id": c.id, "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                    choice["finish_reason"] = _calls_finish(r.finish_reason)
            else:
                choice["message"] = {"role": "assistant", "content": r.text}
            choices.append(choice)
        return JSONResponse(
            {"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion",
             "created": created, "model": req.lora or svc.model_name, "choices": choices,
             "usage": _usage(_total_usage([r.usage for r in results])),
             "kvserve_worker": results[0].worker_id},
            headers=worker_headers(results[0].worker_id,
                                   results[0].prefill_worker_id or results[0].worker_id))

    chunks = stream_all(svc, reqs, leases)
    try:
        first = await chunks.__anext__()
    except BaseException:  # an error status, or the client left before the first chunk
        leases.close()
        raise
    c = first[1]
    return LeasedStreamingResponse(
        _sse(svc, chunks, first, rid, created, kind, body.include_usage(), _plan(body),
             req.lora or svc.model_name), leases,
        media_type="text/event-stream",
        # sent before the stream: the worker it decodes on as routed (a hand-off that is
        # recomputed elsewhere, or a later move, ends it on another: `kvserve_worker` says)
        headers=worker_headers(c.get("decode_worker_id", c["worker_id"]),
                               c.get("prefill_worker_id", c["worker_id"])),
    )


def worker_headers(worker: str, prefill_worker: str) -> dict[str, str]:
    """`x-kvserve-worker`: the worker that decodes the request (of its first choice);
    `x-kvserve-prefill-worker`: the one that ran its prompt (the same one unless a prefill
    worker handed it over, disaggregated serving)."""
    return {"x-kvserve-worker": worker, "x-kvserve-prefill-worker": prefill_worker}


def _plan(body: _SamplingFields) -> ToolPlan | None:
    """The chat request's tools when its answer may hold calls."""
    plan = getattr(body, "_plan", None)
    return plan if plan is not None and plan.returns_calls else None


def _calls_finish(reason: str) -> str:
    # a call cut off by the length limit keeps "length", as OpenAI's does
    return "tool_calls" if reason == "stop" else reason


class LeasedStreamingResponse(StreamingResponse):
    """A stream that gives back its request's router slots when the response ends, however
    it ends. On a client disconnect Starlette cancels the sending task and abandons the
    body iterator where it stands (often at a `yield`, which no `finally` sees until the
    generator is garbage-collected); this closes the leases, then the iterator, at once."""

    def __init__(self, content: AsyncIterator[str], leases: Leases, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.leases = leases

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.leases.close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _total_usage(usages: list[list[int]]) -> list[int]:
    """One prompt (counted once, as OpenAI does for `n`), the completions summed."""
    return [usages[0][0], usages[0][1], sum(u[2] for u in usages)]


async def _sse(
    svc: Service, chunks: AsyncIterator[tuple[int, dict[str, Any]]], first: tuple[int, dict[str, Any]],
    rid: str, created: int, kind: str, include_usage: bool, plan: ToolPlan | None = None,
    model: str = "",
) -> AsyncIterator[str]:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    lps = _Logprobs(svc, kind)
    last: dict[int, dict[str, Any]] = {}  # each choice's latest chunk (for its usage)
    calls: dict[int, ToolStream] = {}  # each choice's content and tool calls (with tools)
    made_calls: set[int] = set()

    def event(i: int, c: dict[str, Any]) -> str:
        lp = lps.of(c["token_ids"], c.get("logprobs"), c.get("top_logprobs"))
        finish = c["finish_reason"]
        if kind == "completion":
            choice = {"index": i, "text": c["text"], "finish_reason": finish,
                      "logprobs": lp}
        else:  # a choice's first delta names the role
            delta: dict[str, Any] = {"content": c["text"]}
            if plan is not None:
                ts = calls.setdefault(i, ToolStream(plan.forced, svc.tool_parser))
                text, deltas = ts.feed(c["text"])
                if finish is not None:
                    more, late = ts.finish()
                    text, deltas = text + more, deltas + late
                delta = {"content": text}
                if deltas:
                    made_calls.add(i)
                    delta["tool_calls"] = [_call_delta(d) for d in deltas]
                if finish is not None and i in made_calls:
                    finish = _calls_finish(finish)
            if i not in last:
                delta = {"role": "assistant"} | delta
            choice = {"index": i, "delta": delta, "finish_reason": finish,
                      "logprobs": lp}
        last[i] = c
        payload = {"id": rid, "object": obj, "created": created, "model": model,
                   "choices": [choice], "kvserve_worker": c["worker_id"]}
        return f"data: {json.dumps(payload)}\n\n"

    try:
        yield event(*first)
        async for i, c in chunks:
            yield event(i, c)
    except ServiceError as e:  # mid-stream failure: the status line is already sent
        yield f"data: {json.dumps(e.openai_body())}\n\n"
        return
    finally:
        await chunks.aclose()
    if include_usage:
        usage = _total_usage([last[i]["usage"] for i in sorted(last)])
        payload = {"id": rid, "object": obj, "created": created, "model": model,
                   "choices": [], "usage": _usage(usage)}
        yield f"data: {json.dumps(payload)}\n\n"
    yield "data: [DONE]\n\n"


def _call_delta(d: Any) -> dict[str, Any]:
    """OpenAI's streamed tool call: the first delta has the id, type and name."""
    out: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
    if d.id is not None:
        out["id"], out["type"] = d.id, "function"
        out["function"]["name"] = d.name
    return out


class _Logprobs:
    """OpenAI's logprobs objects: the legacy completions layout or chat's `content` list.

    One per response; a stream's chunks go through it in order (completions' text_offset
    counts from the start of the whole completion).
    """

    def __init__(self, svc: Service, kind: str) -> None:
        self.svc, self.kind, self.offset = svc, kind, 0

    def of(
        self, ids: list[int], lps: list[float] | None, tops: list[list] | None
    ) -> dict[str, Any] | None:
        if lps is None:
            return None
        text = self.svc.token_text
        alts = [tops[i] if tops else [] for i in range(len(ids))]
        if self.kind == "chat":
            def entry(t: int, lp: float) -> dict[str, Any]:
                s = text(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

            return {"content": [
                entry(t, lp) | {"top_logprobs": [entry(a, b) for a, b in alt]}
                for t, lp, alt in zip(ids, lps, alts, strict=True)
            ]}
        tokens = [text(t) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(self.offset)
            self.offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": list(lps),
            "top_logprobs": [{text(a): b for a, b in alt} for alt in alts] if tops else None,
            "text_offset": offsets,
        }
