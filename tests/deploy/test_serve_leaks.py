"""Router slots under disconnects: after mixed load with clients leaving mid-stream, every
worker's in-flight count returns to 0 and every KV block is free (real HTTP and gRPC clients)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import grpc
import pytest

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

WORDS = ("the river runs past old stone walls where children play and merchants call out "
         "their prices under a pale autumn sky while bells ring from the distant tower").split()
MAX_TOKENS = 64


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 260)))


def _wait_quiet(serve_app, timeout: float = 45.0) -> list[dict]:
    """Until the router counts no request in flight and every worker is idle with all KV free
    (the router's reconciliation empties the count too: the tests check it corrected nothing)."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        info = serve_app.server_info()["workers"]
        stats = [ray.get(w.stats.remote()) for w in serve_app.workers()]
        busy = [w for w in info if w["inflight"]] + [
            s for s in stats if s["running"] or s["waiting"] or s["kv_blocks_used"]]
        if not busy:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"not quiet {timeout:.0f} s after the load: {busy}")
        time.sleep(0.2)


async def _http_stream(session: aiohttp.ClientSession, url: str, headers: dict, prompt: str,
                       leave_after: int | None) -> str | None:
    """One streaming completion; closes the connection after `leave_after` chunks and returns
    None. A stream may end in fewer chunks than that (tokens merge into a chunk when the client
    reads slower than the engine steps): it then returns its whole answer like a stayer."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, chunks, finish = [], 0, None
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                assert finish in ("stop", "length"), finish  # the whole answer came
                return "".join(text)
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            text.append(data["choices"][0]["text"])
            finish = data["choices"][0].get("finish_reason") or finish
            chunks += 1
            if leave_after is not None and chunks >= leave_after and finish is None:
                resp.close()  # the client goes away mid-stream
                return None
    raise AssertionError("the stream ended without [DONE]")


BAD_HTTP = [
    b"{not json", b'{"prompt": "hi", "max_tokens": -3}', b'{"prompt": "hi", "model": "nope"}',
    b'{"prompt": "hi", "n": 99}', b'{"prompt": "", "max_tokens": 4}', b'{"max_tokens": 4}',
    b'{"prompt": "hi", "temperature": "hot"}', b'{"prompt": [999999999]}',
    b'{"prompt": "hi", "max_tokens": 100000}', b'{"prompt": "hi", "top_p": 7}',
    b'{"prompt": "hi", "stream": true, "n": 0}', b"[]",
]


async def _http_load(serve_app) -> tuple[list[int | None], list[str | None], list[int]]:
    rng = random.Random(7)
    headers = {"authorization": f"Bearer {serve_app.api_key}"}
    url = serve_app.http_url
    # a third of the 48 leave: after 1, 3 or 10 chunks
    leave = [None, None, 1, None, None, 3, None, None, 10, None, None, 3] * 4
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def bad(b: bytes) -> int:
            async with s.post(url + "/v1/completions", data=b, headers={
                    **headers, "content-type": "application/json"}) as r:
                await r.read()
                return r.status

        streams = [_http_stream(s, url, headers, _prompt(rng), n) for n in leave]
        res = await asyncio.gather(*streams, *(bad(b) for b in BAD_HTTP))
    return leave, res[:len(leave)], res[len(leave):]


def _greedy_http(serve_app) -> str:
    import urllib.request

    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 12,
                       "temperature": 0}).encode()
    req = urllib.request.Request(serve_app.http_url + "/v1/completions", data=body, headers={
        "content-type": "application/json", "authorization": f"Bearer {serve_app.api_key}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _corrections(serve_app) -> int:
    return sum(w["reconciled_slots"] for w in serve_app.server_info()["workers"])


@pytest.mark.slow
def test_http_disconnects_leave_no_inflight_slot(serve_app):
    serve_app.wait_all_alive()
    before = _greedy_http(serve_app)
    corrected = _corrections(serve_app)
    leave, texts, bad = asyncio.run(_http_load(serve_app))
    assert all(400 <= s < 500 for s in bad), bad
    # those that stayed got their whole answer; clients did leave mid-stream (a first chunk
    # goes at once, so those leaving after one chunk leave unless their client was stalled)
    assert all(t for n, t in zip(leave, texts, strict=True) if n is None), texts
    assert any(t is None for t in texts), texts
    _wait_quiet(serve_app)
    # the ingress gave every slot back itself: the router's reconciliation had nothing to fix
    assert _corrections(serve_app) == corrected
    assert _greedy_http(serve_app) == before


async def _grpc_load(serve_app) -> tuple[list[int | None], list[grpc.StatusCode]]:
    rng = random.Random(11)
    md = serve_app.metadata
    async with grpc.aio.insecure_channel(serve_app.grpc_target) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)

        async def one(leave_after: int | None) -> grpc.StatusCode:
            """OK when the stream ended, CANCELLED when the client left it mid-stream (a stream
            can end in fewer messages than `leave_after`: tokens merge when reads lag)."""
            call = stub.GenerateStream(pb.GenerateRequest(
                prompt=_prompt(rng), sampling=pb.SamplingParams(max_tokens=MAX_TOKENS,
                                                                temperature=0)), metadata=md)
            n = 0
            try:
                async for r in call:
                    n += 1
                    if leave_after is not None and n >= leave_after and not r.finish_reason:
                        call.cancel()
                        return grpc.StatusCode.CANCELLED
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        async def bad(req: pb.GenerateRequest) -> grpc.StatusCode:
            try:
                async for _ in stub.GenerateStream(req, metadata=md):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        bads = [pb.GenerateRequest(prompt=""),
                pb.GenerateRequest(prompt="hi", model="nope"),
                pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=100000)),
                pb.GenerateRequest(prompt_token_ids=[999999999])]
        leave = [None, 1, None, 3, None, 10] * 4
        codes = await asyncio.gather(*(one(n) for n in leave), *(bad(b) for b in bads))
        return leave, list(codes)


def test_grpc_cancelled_streams_leave_no_inflight_slot(serve_app):
    serve_app.wait_all_alive()
    corrected = _corrections(serve_app)
    leave, codes = asyncio.run(_grpc_load(serve_app))
    ok, cancelled = grpc.StatusCode.OK, grpc.StatusCode.CANCELLED
    # stayers ended well; the others left mid-stream or ended before their leaving point
    assert [c for n, c in zip(leave, codes[:24], strict=True) if n is None] == [ok] * 12, codes
    assert all(c in (ok, cancelled) for c in codes[:24]) and cancelled in codes, codes
    invalid, not_found = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    assert codes[24:] == [invalid, not_found, invalid, invalid], codes
    _wait_quiet(serve_app)
    assert _corrections(serve_app) == corrected


def test_router_drops_a_slot_whose_release_never_came(serve_app):
    """The second line of defence: a slot no worker knows is dropped after the grace period,
    counted and shown by both front ends' server info."""
    import ray

    router = serve_app.router
    old = ray.get(router.set_slot_grace_s.remote(1.0))
    try:
        before = {w["worker_id"]: w["reconciled_slots"] for w in serve_app.server_info()["workers"]}
        pick = ray.get(router.pick.remote([], None, [], "req-lost-release"))  # never released
        assert serve_app.server_info()["workers"][pick["idx"]]["inflight"] == 1
        info = _wait_quiet(serve_app, timeout=60)
        assert info[pick["idx"]]["reconciled_slots"] == before[pick["worker_id"]] + 1
        assert ray.get(router.release.remote(pick["idx"], pick["slot_id"])) is False  # late: ignored
        with grpc.insecure_channel(serve_app.grpc_target) as ch:
            r = kvserve_pb2_grpc.KVServeStub(ch).GetServerInfo(pb.GetServerInfoRequest(),
                                                                metadata=serve_app.metadata)
        w = {x.worker_id: x for x in r.workers}[pick["worker_id"]]
        assert (w.inflight, w.reconciled_slots) == (0, before[pick["worker_id"]] + 1)
    finally:
        ray.get(router.set_slot_grace_s.remote(old))


@pytest.fixture(autouse=True)
def _quiet_before(serve_app):
    """Earlier tests' requests must not count against these ones."""
    _wait_quiet(serve_app, timeout=60)
