"""The soak's steady mixed load: each client loops over request kinds drawn by weight.

Kinds: HTTP and gRPC, streaming and unary; two-turn sessions; clients that leave a stream
after a few chunks (HTTP connection closed, gRPC call cancelled); malformed requests, which
must get a 4xx / INVALID_ARGUMENT; long prompts that press the KV pool into evictions.
Every request ends as one `Outcome`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

WORDS = ("the river runs past old stone walls where children play and merchants call out "
         "their prices under a pale autumn sky while bells ring from the distant tower "
         "across fields of barley and a narrow road winds toward the hills").split()

KINDS = {  # kind -> weight in the mix
    "http_stream": 4, "http_unary": 2, "grpc_stream": 4, "grpc_unary": 2, "session": 2,
    "http_leave": 2, "grpc_cancel": 2, "bad_http": 1, "bad_grpc": 1, "long": 1,
}
BAD_HTTP = [b"{not json", b'{"prompt": "hi", "max_tokens": -3}', b'{"prompt": "hi", "n": 99}',
            b'{"prompt": [999999999]}', b'{"prompt": "hi", "top_p": 7}', b"[]",
            b'{"prompt": "hi", "max_tokens": 100000}']


@dataclass
class Outcome:
    kind: str
    start: float  # monotonic
    end: float
    status: str  # "ok", "left" (the client left on purpose), "http_<code>", "grpc_<CODE>", "error"
    ttft: float | None = None
    tokens: int = 0
    expected_error: bool = False  # a malformed request: a 4xx is the right answer
    message: str = ""


def prompt(rng: random.Random, lo: int = 40, hi: int = 260) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


class Load:
    def __init__(self, http_url: str, grpc_target: str, api_key: str | None,
                 max_tokens: int = 64, seed: int = 0) -> None:
        self.http_url, self.grpc_target = http_url, grpc_target
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.md = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.max_tokens = max_tokens
        self.seed = seed
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self.kinds = list(KINDS)
        self.weights = [KINDS[k] for k in self.kinds]

    async def run(self, concurrency: int, until: float) -> None:
        import aiohttp
        import grpc

        from kvserve.protos import kvserve_pb2_grpc

        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as http, \
                grpc.aio.insecure_channel(self.grpc_target) as ch:
            self.http, self.stub = http, kvserve_pb2_grpc.KVServeStub(ch)
            await asyncio.gather(*(self._client(i, until) for i in range(concurrency)))

    async def _client(self, i: int, until: float) -> None:
        rng = random.Random(self.seed * 1000 + i)
        while time.monotonic() < until:
            kind = rng.choices(self.kinds, self.weights)[0]
            t0 = time.monotonic()
            self.in_flight += 1
            try:
                out = await getattr(self, "_" + kind)(rng, t0)
            except Exception as e:  # a failure the client saw: kept, with its text
                out = Outcome(kind, t0, time.monotonic(), _status(e), message=str(e)[:300])
            finally:
                self.in_flight -= 1
            out.kind = kind
            self.outcomes.append(out)

    # ---- HTTP -------------------------------------------------------------------------------
    async def _sse(self, body: dict, t0: float, leave_after: int | None = None) -> Outcome:
        o = Outcome("", t0, 0.0, "ok")
        async with self.http.post(self.http_url + "/v1/completions", json=body,
                                  headers=self.headers) as r:
            if r.status != 200:
                return Outcome("", t0, time.monotonic(), f"http_{r.status}",
                               message=(await r.text())[:300])
            chunks = 0
            async for raw in r.content:
                if not raw.startswith(b"data: {"):
                    continue
                data = json.loads(raw[6:])
                if "error" in data:  # a failure after the 200 status line
                    code = data["error"].get("code", 500)
                    return Outcome("", t0, time.monotonic(), f"http_{code}",
                                   message=data["error"]["message"][:300])
                o.ttft = o.ttft if o.ttft is not None else time.monotonic() - t0
                o.tokens += 1
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    r.close()
                    o.status = "left"
                    break
        o.end = time.monotonic()
        return o

    def _body(self, rng: random.Random, stream: bool, **extra: Any) -> dict:
        return {"prompt": prompt(rng), "max_tokens": self.max_tokens, "temperature": 0,
                "stream": stream, **extra}

    async def _http_stream(self, rng: random.Random, t0: float) -> Outcome:
        return await self._sse(self._body(rng, True), t0)

    async def _http_leave(self, rng: random.Random, t0: float) -> Outcome:
        return await self._sse(self._body(rng, True), t0, leave_after=rng.choice((1, 3, 10)))

    async def _long(self, rng: random.Random, t0: float) -> Outcome:
        """A long prompt: with a small KV pool it evicts (parks) other streams."""
        body = {"prompt": prompt(rng, 500, 700), "max_tokens": self.max_tokens,
                "temperature": 0, "stream": True}
        return await self._sse(body, t0)

    async def _http_unary(self, rng: random.Random, t0: float) -> Outcome:
        async with self.http.post(self.http_url + "/v1/completions",
                                  json=self._body(rng, False), headers=self.headers) as r:
            text = await r.text()
            now = time.monotonic()
            if r.status != 200:
                return Outcome("", t0, now, f"http_{r.status}", message=text[:300])
            return Outcome("", t0, now, "ok", ttft=now - t0,
                           tokens=json.loads(text)["usage"]["completion_tokens"])

    async def _session(self, rng: random.Random, t0: float) -> Outcome:
        """Two chat turns with one session id (the second reuses the first's KV)."""
        sid = f"soak-{rng.getrandbits(48):x}"
        msgs = [{"role": "user", "content": prompt(rng, 20, 80)}]
        tokens = 0
        for turn in range(2):
            body = {"messages": msgs, "max_tokens": self.max_tokens // 2, "temperature": 0,
                    "session_id": sid}
            async with self.http.post(self.http_url + "/v1/chat/completions", json=body,
                                      headers=self.headers) as r:
                text = await r.text()
                if r.status != 200:
                    return Outcome("", t0, time.monotonic(), f"http_{r.status}",
                                   message=text[:300])
                d = json.loads(text)
                tokens += d["usage"]["completion_tokens"]
                msgs += [{"role": "assistant", "content": d["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "and then?"}]
            if turn == 0:
                ttft = time.monotonic() - t0
        return Outcome("", t0, time.monotonic(), "ok", ttft=ttft, tokens=tokens)

    async def _bad_http(self, rng: random.Random, t0: float) -> Outcome:
        async with self.http.post(self.http_url + "/v1/completions", data=rng.choice(BAD_HTTP),
                                  headers={**self.headers, "content-type": "application/json"}) as r:
            text = await r.text()
            return Outcome("", t0, time.monotonic(), f"http_{r.status}", expected_error=True,
                           message=text[:200])

    # ---- gRPC -------------------------------------------------------------------------------
    def _greq(self, rng: random.Random) -> Any:
        from kvserve.protos import kvserve_pb2 as pb

        return pb.GenerateRequest(prompt=prompt(rng), sampling=pb.SamplingParams(
            max_tokens=self.max_tokens, temperature=0))

    async def _grpc_stream(self, rng: random.Random, t0: float,
                           cancel_after: int | None = None) -> Outcome:
        o = Outcome("", t0, 0.0, "ok")
        call = self.stub.GenerateStream(self._greq(rng), metadata=self.md)
        async for r in call:
            o.ttft = o.ttft if o.ttft is not None else time.monotonic() - t0
            o.tokens += len(r.delta_token_ids)
            if cancel_after is not None and o.tokens >= cancel_after:
                call.cancel()
                o.status = "left"
                break
        o.end = time.monotonic()
        return o

    async def _grpc_cancel(self, rng: random.Random, t0: float) -> Outcome:
        return await self._grpc_stream(rng, t0, cancel_after=rng.choice((1, 3, 10)))

    async def _grpc_unary(self, rng: random.Random, t0: float) -> Outcome:
        r = await self.stub.Generate(self._greq(rng), metadata=self.md)
        now = time.monotonic()
        return Outcome("", t0, now, "ok", ttft=now - t0, tokens=r.usage.completion_tokens)

    async def _bad_grpc(self, rng: random.Random, t0: float) -> Outcome:
        from kvserve.protos import kvserve_pb2 as pb

        bad = rng.choice([pb.GenerateRequest(prompt=""),
                          pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=7)),
                          pb.GenerateRequest(prompt_token_ids=[999999999])])
        try:
            await self.stub.Generate(bad, metadata=self.md)
        except Exception as e:
            return Outcome("", t0, time.monotonic(), _status(e), expected_error=True,
                           message=str(e)[:200])
        return Outcome("", t0, time.monotonic(), "ok", expected_error=True)


def _status(e: BaseException) -> str:
    code = getattr(e, "code", None)
    if callable(code):  # grpc.aio.AioRpcError
        return f"grpc_{code().name}"
    return "error"


def is_server_error(o: Outcome) -> bool:
    """A 5xx, or a gRPC status that means the server failed (not the client's input)."""
    if o.status.startswith("http_"):
        return o.status[5:].isdigit() and int(o.status[5:]) >= 500
    return o.status in ("grpc_INTERNAL", "grpc_UNKNOWN", "grpc_UNAVAILABLE",
                        "grpc_DEADLINE_EXCEEDED", "error")
