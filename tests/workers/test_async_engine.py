"""AsyncLLMEngine: many concurrent streams, cancellation, bad input, KV hygiene."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvserve.config import EngineConfig
from kvserve.errors import InvalidRequestError
from kvserve.sampling import SamplingParams
from kvserve.workers.engine.async_engine import AsyncLLMEngine


@pytest.fixture(scope="module")
def aengine(smol_path):
    eng = AsyncLLMEngine(EngineConfig(model=smol_path, kv_cache_tokens=16384, max_num_seqs=64))
    yield eng
    eng.shutdown()


async def collect(eng: AsyncLLMEngine, prompt, params, rid=None):
    ids, text, last = [], "", None
    async for out in eng.generate(prompt, params, rid):
        ids += out.delta_token_ids
        text += out.delta_text
        last = out
    return ids, text, last


def wait_idle(eng: AsyncLLMEngine, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = eng.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {eng.stats()}")


@pytest.mark.slow
def test_64_concurrent_requests_match_solo_runs(aengine):
    rng = random.Random(7)
    reqs = []
    for _ in range(64):
        n = rng.choice([3, 9, 20, 45, 90, 150])
        prompt = [rng.randrange(100, 40000) for _ in range(n)]
        reqs.append((prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True)))

    async def together():
        return await asyncio.gather(*(collect(aengine, p, sp) for p, sp in reqs))

    batched = asyncio.run(together())

    async def solo():
        return [await collect(aengine, p, sp) for p, sp in reqs]

    alone = asyncio.run(solo())
    for (ids, text, last), (ids_a, text_a, _), (_, sp) in zip(batched, alone, reqs, strict=True):
        assert ids == ids_a
        assert text == text_a == last.text
        assert len(ids) == sp.max_tokens and last.finish_reason == "length"
        assert last.usage.completion_tokens == len(ids)
    wait_idle(aengine)


async def until(cond, what: str, timeout: float = 30.0) -> None:
    """Wait (bounded) for a state the test observes, not for a guessed time."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.01)


def test_cancel_consumer_aborts_and_frees_blocks(aengine):
    async def run():
        got = 0
        agen = aengine.generate("Tell me a very long story.", SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in agen:
            got += len(out.delta_token_ids)
            if got >= 3:
                break
        await agen.aclose()
        # a task cancelled while it waits for its next token aborts as well: the engine is
        # held after the stream's first step, so the stream is certainly mid-generation
        await aengine.pause()
        try:
            tokens: list[int] = []

            async def read() -> None:
                async for out in aengine.generate("Another long story:", SamplingParams(max_tokens=500, ignore_eos=True), "cut"):
                    tokens.extend(out.delta_token_ids)

            task = asyncio.create_task(read())
            await until(lambda: "cut" in aengine.unfinished_ids(), "the request never arrived")
            await aengine.step()
            await until(lambda: tokens, "no first token")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: "cut" not in aengine.unfinished_ids(), "not aborted while held")
        finally:
            aengine.unpause()
        return got, len(tokens)

    got, cut = asyncio.run(run())
    assert got >= 3 and cut == 1
    wait_idle(aengine)


def test_bad_input_raises_and_others_keep_streaming(aengine):
    async def run():
        good = asyncio.create_task(collect(aengine, "Count: 1, 2,", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
        with pytest.raises(InvalidRequestError):
            await collect(aengine, "", SamplingParams())
        with pytest.raises(InvalidRequestError):
            await collect(aengine, list(range(100, 9000)), SamplingParams())
        with pytest.raises(ValueError):
            SamplingParams(temperature=float("nan"))
        ids, _, last = await good
        return ids, last

    ids, last = asyncio.run(run())
    assert len(ids) == 10 and last.finish_reason == "length"
    wait_idle(aengine)


def test_duplicate_request_id_rejected(aengine):
    async def run():
        await aengine.pause()  # the first request cannot finish before the second arrives
        try:
            t1 = asyncio.create_task(collect(aengine, "a b c", SamplingParams(max_tokens=30, ignore_eos=True), "same"))
            await until(lambda: "same" in aengine.unfinished_ids(), "the first never arrived")
            with pytest.raises(InvalidRequestError, match="already in use"):
                await collect(aengine, "d e f", SamplingParams(max_tokens=3), "same")
        finally:
            aengine.unpause()
        return await t1

    ids, _, _ = asyncio.run(run())
    assert len(ids) == 30
    wait_idle(aengine)


def test_an_abort_goes_before_a_call_queued_after_it(aengine):
    """An abort that arrives while the engine thread serves calls, then a call under the same
    request id (a failed hand-off's stream recomputed on the worker that was told to abort
    it): the abort goes first, so it cannot end what the call brought in."""
    import threading
    from types import SimpleNamespace

    started, gate = threading.Event(), threading.Event()
    marker = SimpleNamespace(imported_at=time.monotonic())  # (an imported stream's stand-in)

    def blocking() -> None:
        started.set()
        assert gate.wait(30)

    async def run():
        first = aengine._call(blocking)
        assert await asyncio.to_thread(started.wait, 30)
        aengine.abort("late")  # queued while the engine thread is inside the calls
        second = aengine._call(lambda: aengine._unclaimed.__setitem__("late", marker))
        gate.set()
        await first
        await second
        await asyncio.sleep(0.2)  # (the engine thread passes again)
        return await aengine._call(lambda: aengine._unclaimed.pop("late", None))

    assert asyncio.run(run()) is marker
