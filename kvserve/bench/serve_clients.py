"""The three ways `kvserve bench serve` sends a request: gRPC, OpenAI HTTP, in-process engine.

Each client streams one request and times it from its own side (kvserve.bench.serve_metrics
has the definitions). All three send the same token ids with the same sampling: greedy,
EOS ignored, exactly `output_len` new tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Protocol

from kvserve.bench.serve_dataset import BenchRequest
from kvserve.bench.serve_metrics import RequestResult


class BenchClient(Protocol):
    name: str

    async def start(self) -> None: ...

    async def send(self, req: BenchRequest) -> RequestResult: ...

    async def close(self) -> None: ...


class _Timing:
    """Per-request clock: TTFT at the first token-carrying chunk, ITL between such chunks."""

    def __init__(self, req: BenchRequest) -> None:
        self.res = RequestResult(prompt_len=req.prompt_len)
        self.t0 = self.last = time.perf_counter()
        self.res.start = self.t0
        self.chunks: list[str] = []

    def tokens(self, n: int, text: str = "") -> None:
        now = time.perf_counter()
        if n <= 0:
            return
        if self.res.output_len == 0:
            self.res.ttft = now - self.t0
        else:
            self.res.itl.append(now - self.last)
        self.last = now
        self.res.output_len += n
        if text:
            self.chunks.append(text)

    def usage(self, prompt: int, cached: int, completion: int) -> None:
        # the server's counts are the truth (e.g. a chunk of text can hold several tokens)
        if prompt > 0:
            self.res.prompt_len = prompt
        self.res.cached_tokens = cached
        if completion > 0:
            self.res.output_len = completion

    def done(self, error: str = "") -> RequestResult:
        self.res.latency = time.perf_counter() - self.t0
        self.res.generated_text = "".join(self.chunks)
        self.res.success = not error and self.res.output_len > 0
        self.res.error = error or ("" if self.res.success else "no tokens returned")
        return self.res


def _auth(api_key: str | None) -> str | None:
    return f"Bearer {api_key}" if api_key else None


# ---- gRPC ------------------------------------------------------------------------------------
class GrpcClient:
    name = "grpc"

    def __init__(
        self, host: str, port: int, model: str | None = None, api_key: str | None = None
    ) -> None:
        self.target = f"{host}:{port}"
        self.model = model
        auth = _auth(api_key)
        self.metadata = (("authorization", auth),) if auth else ()
        self.channel: Any = None
        self.stub: Any = None

    async def start(self) -> None:
        import grpc

        from kvserve.protos import kvserve_pb2 as pb
        from kvserve.protos import kvserve_pb2_grpc

        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = kvserve_pb2_grpc.KVServeStub(self.channel)
        if self.model is None:
            models = await self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata)
            self.model = models.models[0].id if models.models else ""

    async def send(self, req: BenchRequest) -> RequestResult:
        import grpc

        from kvserve.protos import kvserve_pb2 as pb

        msg = pb.GenerateRequest(
            model=self.model,
            prompt_token_ids=req.prompt_ids,
            sampling=pb.SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True),
            session_id=req.session_id,
        )
        t = _Timing(req)
        try:
            async for chunk in self.stub.GenerateStream(msg, metadata=self.metadata):
                t.tokens(len(chunk.delta_token_ids), chunk.delta_text)
                t.res.worker = chunk.worker_id or t.res.worker
                if chunk.finish_reason and chunk.HasField("usage"):
                    u = chunk.usage
                    t.usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
        except grpc.aio.AioRpcError as e:
            return t.done(f"{e.code().name}: {e.details()}")
        return t.done()

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


# ---- OpenAI HTTP -----------------------------------------------------------------------------
class HttpClient:
    """POST /v1/completions with stream=true; token ids as the prompt (the OpenAI API allows
    a list of ids) and `ignore_eos` as vLLM's extra parameter."""

    name = "http"

    def __init__(
        self, host: str, port: int, model: str | None = None, api_key: str | None = None
    ) -> None:
        self.base = f"http://{host}:{port}/v1"
        self.url = f"{self.base}/completions"
        self.model = model
        auth = _auth(api_key)
        self.headers = {"Authorization": auth} if auth else {}
        self.session: Any = None

    async def start(self) -> None:
        import aiohttp

        # no connection cap: --max-concurrency is the bench's own limit, not the pool's
        conn = aiohttp.TCPConnector(limit=0)
        self.session = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=6 * 3600)
        )
        if self.model is None:
            async with self.session.get(f"{self.base}/models", headers=self.headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: {await resp.text()}")
                data = (await resp.json()).get("data") or []
                self.model = data[0]["id"] if data else ""

    async def send(self, req: BenchRequest) -> RequestResult:
        body = {
            "prompt": req.prompt_ids,
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        if req.session_id:
            body["session_id"] = req.session_id
        t = _Timing(req)
        try:
            async with self.session.post(self.url, json=body, headers=self.headers) as resp:
                if resp.status != 200:
                    return t.done(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for line in _sse_data(resp.content):
                    if line == "[DONE]":
                        break
                    data = json.loads(line)
                    if "error" in data:
                        return t.done(f"stream error: {data['error']}")
                    t.res.worker = data.get("kvserve_worker") or t.res.worker
                    for choice in data.get("choices") or []:
                        # a chunk is one or more tokens; usage at the end has the exact count
                        text = choice.get("text") or ""
                        if text or choice.get("finish_reason") is None:
                            t.tokens(1, text)
                    if u := data.get("usage"):
                        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                        t.usage(u.get("prompt_tokens", 0), cached, u.get("completion_tokens", 0))
        except Exception as e:  # connection refused / reset: a failed request, not a crash
            return t.done(f"{type(e).__name__}: {e}")
        return t.done()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


async def _sse_data(stream: Any):
    """The `data:` payloads of a server-sent-events body, one per event."""
    async for raw in stream:
        line = raw.decode("utf-8").strip()
        if line.startswith("data:"):
            yield line[5:].strip()


# ---- in-process engine -----------------------------------------------------------------------
class EngineClient:
    """The same requests straight into an AsyncLLMEngine in this process: the baseline."""

    name = "engine"

    def __init__(self, config: Any) -> None:
        self.config = config
        self.engine: Any = None

    async def start(self) -> None:
        import asyncio

        from kvserve.workers.engine.async_engine import AsyncLLMEngine

        # the model load takes seconds: keep the event loop (and its timers) free meanwhile
        self.engine = await asyncio.to_thread(AsyncLLMEngine, self.config)

    async def send(self, req: BenchRequest) -> RequestResult:
        from kvserve.sampling import SamplingParams

        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        t = _Timing(req)
        try:
            async for out in self.engine.generate(req.prompt_ids, params, uuid.uuid4().hex):
                t.tokens(len(out.delta_token_ids), out.delta_text)
                if out.finished:
                    u = out.usage
                    t.usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
        except Exception as e:
            return t.done(f"{type(e).__name__}: {e}")
        return t.done()

    async def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
