"""WorkerActor's body in-process (real engine, no Ray): coalesced chunks, abort, held hashes."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvserve.kvcache.hashing import hash_full_blocks
from kvserve.workers.worker_actor import WorkerActor

ENGINE = {"num_threads": 1, "kv_cache_tokens": 2048, "max_model_len": 512}


@pytest.fixture(scope="module")
def worker():
    w = WorkerActor("worker-t", ENGINE)
    yield w
    w.engine.shutdown()


def _collect(worker, rid: str, ids: list[int], n: int, delay: float) -> list[dict]:
    async def run() -> list[dict]:
        chunks = []
        params = {"max_tokens": n, "temperature": 0, "ignore_eos": True}
        async for c in worker.generate(rid, ids, params):
            chunks.append(c)
            await asyncio.sleep(delay)
        return chunks

    return asyncio.run(run())


def _lockstep(worker, rid: str, ids: list[int], n: int, steps_per_read: int) -> list[dict]:
    """A consumer that reads its next chunk only every `steps_per_read` engine steps: the
    engine is held and stepped by hand, so how far behind the consumer is does not depend
    on how fast this machine runs a step."""
    async def run() -> list[dict]:
        eng = worker.engine
        await eng.pause()
        try:
            gen = worker.generate(rid, ids, {"max_tokens": n, "temperature": 0,
                                             "ignore_eos": True})
            first = asyncio.ensure_future(gen.__anext__())  # the request reaches the engine
            while rid not in eng.unfinished_ids():
                await asyncio.sleep(0.01)
            await eng.step()
            chunks = [await first]
            while chunks[-1]["finish_reason"] is None:
                for _ in range(steps_per_read):
                    await eng.step()
                chunks.append(await gen.__anext__())
            return chunks
        finally:
            eng.unpause()

    return asyncio.run(run())


def test_slow_consumer_gets_coalesced_chunks(worker):
    ids = worker.engine.tokenizer.encode("Once upon a time")
    fast = _collect(worker, "fast", ids, 24, 0.0)
    slow = _lockstep(worker, "slow", ids, 24, 3)  # three steps behind at every read
    tokens = [t for c in fast for t in c["token_ids"]]
    assert len(tokens) == 24 and [t for c in slow for t in c["token_ids"]] == tokens
    assert "".join(c["text"] for c in slow) == "".join(c["text"] for c in fast)
    # the first token goes at once; then each read takes the three steps made meanwhile
    assert [len(c["token_ids"]) for c in slow] == [1] + [3] * 7 + [2]
    assert slow[-1]["finish_reason"] == "length" and slow[-1]["usage"][2] == 24
    assert all(c["worker_id"] == "worker-t" for c in slow)


def test_held_hashes_match_the_routers_hashing(worker):
    ids = worker.engine.tokenizer.encode("A long shared system prompt for everyone. " * 6)
    _collect(worker, "held", ids, 2, 0.0)
    load = asyncio.run(worker.load())
    want = hash_full_blocks(ids, worker.config.block_size)
    assert len(want) >= 2 and set(want) <= set(load["held"]["device"])
    assert load["worker_id"] == "worker-t" and load["kv_blocks_total"] == 128


def test_bad_params_and_abort(worker):
    async def run() -> tuple[list[dict], list[dict]]:
        bad = [c async for c in worker.generate("bad", [1, 2], {"top_p": 3})]
        eng = worker.engine
        await eng.pause()  # the stream is certainly still running when it is aborted
        try:
            agen = worker.generate("long", [1, 2, 3], {"max_tokens": 400, "ignore_eos": True})
            first = asyncio.ensure_future(agen.__anext__())
            while "long" not in eng.unfinished_ids():
                await asyncio.sleep(0.01)
            await eng.step()
            out = [await first]
            assert await worker.abort("long")
            out += [c async for c in agen]
        finally:
            eng.unpause()
        deadline = time.monotonic() + 30  # the engine thread frees it, then refreshes stats
        while eng.stats()["running"] or eng.stats()["kv_blocks_used"]:
            assert time.monotonic() < deadline, eng.stats()
            await asyncio.sleep(0.05)
        return bad, out

    bad, out = asyncio.run(run())
    assert bad[0]["error"] == "invalid" and "top_p" in bad[0]["message"]
    assert len(out) == 1 and len(out[0]["token_ids"]) == 1  # nothing after the abort


def _chunks_with_interval(interval_ms: float, steps_per_read: int = 0) -> list[dict]:
    w = WorkerActor("worker-p", ENGINE, stream_interval_ms=interval_ms)
    try:
        if steps_per_read:
            return _lockstep(w, "paced", [1, 2, 3, 4, 5], 16, steps_per_read)
        return _collect(w, "paced", [1, 2, 3, 4, 5], 16, 0.0)
    finally:
        w.engine.shutdown()


def test_paced_stream_sends_first_token_at_once_and_merges_the_rest():
    # the engine held and stepped by hand: the first token's chunk is read before the second
    # step (not hoped for: on a fast host two free-running steps beat the first read), then
    # the other 15 steps run before the next read
    chunks = _chunks_with_interval(60_000, steps_per_read=15)
    # the first token is not held back, and the end of the stream is not waited for
    assert [len(c["token_ids"]) for c in chunks] == [1, 15]
    assert chunks[0]["finish_reason"] is None and chunks[1]["finish_reason"] == "length"


def test_unpaced_stream_sends_every_step():
    chunks = _chunks_with_interval(0, steps_per_read=1)
    # a consumer that keeps up (reads after every step) gets one chunk per step
    assert [len(c["token_ids"]) for c in chunks] == [1] * 16


def test_pacing_intervals():
    from kvserve.workers.stream_pacing import AUTO_CHUNKS_PER_S, AUTO_MAX_INTERVAL_S, StreamPacing

    auto = StreamPacing.from_config(None, on_gpu=False)
    assert auto.interval(1) == pytest.approx(1 / AUTO_CHUNKS_PER_S)
    assert auto.interval(2) == pytest.approx(2 / AUTO_CHUNKS_PER_S)  # a per-worker budget
    assert auto.interval(1000) == AUTO_MAX_INTERVAL_S  # never more than this apart
    assert StreamPacing.from_config(None, on_gpu=True).interval(64) == 0.0
    assert StreamPacing.from_config(0, on_gpu=False).interval(64) == 0.0
    assert StreamPacing.from_config(120, on_gpu=True).interval(1) == pytest.approx(0.12)


def test_start_up_states_reach_the_reporter():
    calls: list[tuple] = []

    class Router:  # stands for the router's handle: `worker_state.remote(...)`
        class worker_state:  # noqa: N801
            @staticmethod
            def remote(*args: object) -> None:
                calls.append(args)

    w = WorkerActor("worker-s", ENGINE, reporter=Router())
    try:
        assert [c[2] for c in calls] == ["loading", "ready"]  # no graphs on the CPU
        assert all(c[:2] == ("worker-s", w.incarnation) for c in calls)
        assert calls[-1][3] > 0 and w.info()["load_s"] == calls[-1][3]
        assert w.info()["device"] == "cpu"
    finally:
        w.engine.shutdown()
