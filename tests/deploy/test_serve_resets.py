"""Router slots under abrupt client exits: HTTP clients that reset the TCP connection
(RST) mid-stream or before the first chunk, and grpc.aio calls cancelled at random points.
Once the workers are idle the router must count no request in flight, long before its
reconciliation (`slot_grace_s`, 60 s) could have corrected anything."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import time

import grpc
import pytest

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

WORDS = ("a quiet harbour town wakes as boats return with nets full of silver fish while gulls "
         "circle above the market and old sailors trade stories").split()
ROUNDS, CLIENTS = 3, 48  # HTTP: 144 resets; gRPC: as many cancelled calls
SETTLE_S = 12.0  # well under the router's 60 s grace: only a real release empties the count


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))


async def _reset_client(app, rng: random.Random) -> None:
    """A streaming completion whose client resets the connection after 0-6 chunks or at a
    random moment (often while the ingress is between the router's answer and the worker)."""
    body = json.dumps({"prompt": _prompt(rng), "max_tokens": 48, "temperature": 0,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"authorization: Bearer {app.api_key}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", app.http_port)
    chunks, delay = rng.randint(0, 6), rng.uniform(0.0, 3.0)
    try:
        writer.write(head + body)
        await writer.drain()

        async def read_chunks() -> None:
            seen = 0
            while seen < chunks:
                line = await reader.readline()
                if not line:
                    return
                seen += line.startswith(b"data: {")

        await asyncio.wait_for(read_chunks(), timeout=delay if chunks == 0 else 120)
    except asyncio.TimeoutError:
        pass
    finally:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # linger 0: the kernel answers with RST, not FIN


async def _cancel_call(stub, md, rng: random.Random) -> None:
    call = stub.GenerateStream(pb.GenerateRequest(
        prompt=_prompt(rng), sampling=pb.SamplingParams(max_tokens=48, temperature=0)),
        metadata=md)
    chunks, delay = rng.randint(0, 6), rng.uniform(0.0, 3.0)

    async def read() -> None:
        seen = 0
        async for _ in call:
            seen += 1
            if seen >= chunks > 0:
                return

    try:
        await asyncio.wait_for(read(), timeout=delay if chunks == 0 else 120)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        pass
    call.cancel()


def _inflight(app) -> list[int]:
    return [w["inflight"] for w in app.server_info()["workers"]]


def _assert_released(app) -> None:
    """Workers idle, then the router's count at 0 within SETTLE_S."""
    import ray

    deadline = time.monotonic() + 60
    while any(s["running"] or s["waiting"]
              for s in (ray.get(w.stats.remote()) for w in app.workers())):
        assert time.monotonic() < deadline, "workers still busy a minute after the load"
        time.sleep(0.3)
    deadline = time.monotonic() + SETTLE_S
    while (counts := _inflight(app)) != [0] * len(counts):
        assert time.monotonic() < deadline, (
            f"router still counts {counts} requests in flight {SETTLE_S:.0f} s after the "
            f"workers went idle: releases were lost (the ingress holds {app.ingress_slots()} "
            "live slots)")
        time.sleep(0.3)


@pytest.mark.slow
def test_http_connection_resets_leave_no_inflight_slot(serve_app):
    serve_app.wait_all_alive()

    async def load() -> None:
        rng = random.Random(3)
        for _ in range(ROUNDS):
            await asyncio.gather(*(_reset_client(serve_app, rng) for _ in range(CLIENTS)))

    asyncio.run(load())
    _assert_released(serve_app)


@pytest.mark.slow
def test_grpc_calls_cancelled_at_random_leave_no_inflight_slot(serve_app):
    serve_app.wait_all_alive()

    async def load() -> None:
        rng = random.Random(5)
        async with grpc.aio.insecure_channel(serve_app.grpc_target) as ch:
            stub = kvserve_pb2_grpc.KVServeStub(ch)
            for _ in range(ROUNDS):
                await asyncio.gather(*(_cancel_call(stub, serve_app.metadata, rng)
                                       for _ in range(CLIENTS)))

    asyncio.run(load())
    _assert_released(serve_app)
