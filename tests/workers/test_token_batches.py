"""The worker's batched token path in-process (real engine, no Ray): one subscription
carries many requests' chunks in shared batches; an abort mid-batch leaves the others
whole; closing the subscription aborts its requests and frees their KV."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from kvserve.workers.worker_actor import WorkerActor

ENGINE = {"num_threads": 1, "kv_cache_tokens": 2048, "max_model_len": 512}
PARAMS = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def worker():
    w = WorkerActor("worker-b", ENGINE, stream_interval_ms=0)
    yield w
    w.engine.shutdown()


def _prompt(w: WorkerActor, i: int) -> list[int]:
    return w.engine.tokenizer.encode(f"Story number {i} begins on a")


async def _alone(w: WorkerActor, rid: str, ids: list[int]) -> list[int]:
    return [t async for c in w.generate(rid, ids, PARAMS) for t in c["token_ids"]]


@contextlib.asynccontextmanager
async def _held(w: WorkerActor, rids: list[str]) -> AsyncIterator[None]:
    """The engine paused while the block starts requests `rids`; it goes on once all of
    them have reached it, so they share their first step (whatever this machine's speed)."""
    await w.engine.pause()
    try:
        yield
        deadline = time.monotonic() + 30
        while not set(rids) <= set(w.engine.unfinished_ids()):
            assert time.monotonic() < deadline, "the requests never reached the engine"
            await asyncio.sleep(0.01)
    finally:
        w.engine.unpause()


async def _read(sub, got: dict[str, list[dict]], batches: list[dict], until: set[str]) -> None:
    async for item in sub:
        for rid, chunks in item["batch"].items():
            got.setdefault(rid, []).extend(chunks)
        batches.append(item["batch"])
        if until <= {r for r, cs in got.items() if cs and ("end" in cs[-1]
                                                          or cs[-1].get("finish_reason"))}:
            return


def test_one_subscription_carries_every_stream_in_shared_batches(worker):
    async def run():
        want = {f"r{i}": await _alone(worker, f"alone{i}", _prompt(worker, i)) for i in range(6)}
        sub = worker.subscribe("s1")
        assert (await sub.__anext__()) == {"subscribed": worker.incarnation}
        async with _held(worker, [f"r{i}" for i in range(6)]):  # all six start together
            for i in range(6):
                assert await worker.start("s1", f"r{i}", _prompt(worker, i), PARAMS)
        assert not await worker.start("nope", "x", [1, 2], PARAMS)  # unknown subscription
        got: dict[str, list[dict]] = {}
        batches: list[dict] = []
        await asyncio.wait_for(_read(sub, got, batches, set(want)), 120)
        await sub.aclose()
        return want, got, batches

    want, got, batches = asyncio.run(run())
    for rid, tokens in want.items():
        assert [t for c in got[rid] for t in c["token_ids"]] == tokens, rid
        assert got[rid][-1]["finish_reason"] == "length"
    # every step's chunks of all six streams travel together, not one item per stream
    assert max(len(b) for b in batches) == 6
    assert len(batches) < sum(len(c) for c in got.values()) / 3


def test_abort_mid_batch_and_closing_the_subscription(worker):
    async def run():
        want = await _alone(worker, "ref", _prompt(worker, 1))
        sub = worker.subscribe("s2")
        await sub.__anext__()
        long = dict(PARAMS, max_tokens=400)
        async with _held(worker, ["keep", "cut", "left"]):  # the three start together
            await worker.start("s2", "keep", _prompt(worker, 1), PARAMS)
            await worker.start("s2", "cut", _prompt(worker, 2), long)
            await worker.start("s2", "left", _prompt(worker, 3), long)
        got: dict[str, list[dict]] = {}
        item = await sub.__anext__()  # first tokens of all three
        for rid, chunks in item["batch"].items():
            got.setdefault(rid, []).extend(chunks)
        assert await worker.abort("cut")  # what the ingress sends when a client leaves
        await asyncio.wait_for(_read(sub, got, [], {"keep", "cut"}), 120)
        assert "left" in worker._subs["s2"].drivers  # still streaming
        await sub.aclose()  # the ingress replica is gone: its requests are aborted
        await asyncio.sleep(0.2)
        return want, got

    want, got = asyncio.run(run())
    assert [t for c in got["keep"] for t in c["token_ids"]] == want
    assert got["cut"][-1] == {"end": True}
    assert worker.subscriptions() == {}
    deadline = time.monotonic() + 30
    while worker.engine.stats()["kv_blocks_used"] or worker.engine.unfinished_ids():
        assert time.monotonic() < deadline, worker.engine.stats()
        time.sleep(0.05)
