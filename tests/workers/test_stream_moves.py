"""Stream moves between two WorkerActor bodies in-process (real engines, no Ray): export on
the step thread, import, hand-over to the old consumer, resume on the new worker; a
rolled-back move; an abort racing a move; a snapshot of another geometry refused."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
from engine_runs import held_mid_stream

from kvserve.workers.worker_actor import WorkerActor

ENGINE = {"num_threads": 1, "kv_cache_tokens": 2048, "max_model_len": 512}
PARAMS = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair():
    a, b = WorkerActor("worker-0", ENGINE), WorkerActor("worker-1", ENGINE)
    yield a, b
    a.engine.shutdown()
    b.engine.shutdown()


def _ids(w: WorkerActor) -> list[int]:
    return w.engine.tokenizer.encode("The history of the printing press begins")


def wait_clean(*workers: WorkerActor) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(w.engine.stats()["kv_blocks_used"] == 0 and not w.engine.unfinished_ids()
               and w.engine.stats()["host_blocks_used"] == 0 for w in workers):
            return
        time.sleep(0.05)
    raise AssertionError([w.engine.stats() for w in workers])


async def _whole(w: WorkerActor, rid: str) -> tuple[list[int], str, dict]:
    ids, text, last = [], "", {}
    async for c in w.generate(rid, _ids(w), PARAMS):
        ids += c["token_ids"]
        text += c["text"]
        last = c
    return ids, text, last


async def _held_mid_stream(w: WorkerActor, rid: str, steps: int) -> tuple[object, list[dict]]:
    """`rid` started on `w` with its engine held: `steps` steps run and its first chunk
    read; it cannot finish (or go on) until the caller unpauses the engine."""
    return await held_mid_stream(w, rid, _ids(w), PARAMS, steps)


def test_moved_stream_continues_without_repeats(pair):
    a, b = pair

    async def run():
        want = await _whole(a, "ref")
        gen, got = await _held_mid_stream(a, "m", 5)
        try:
            meta, data = await a.export_stream("m")
            assert meta["bytes"] == len(data) > 0
            assert (await b.import_stream(data)) == {"request_id": "m"}
            assert await a.hand_over("m", 1)
        finally:
            a.engine.unpause()
        rest = [c async for c in gen]
        assert rest[-1] == {"moved_to": 1, "worker_id": "worker-0"}
        got += rest[:-1]
        got += [c async for c in b.resume("m")]
        return want, got

    (want_ids, want_text, want_last), got = asyncio.run(run())
    assert [t for c in got for t in c["token_ids"]] == want_ids
    assert "".join(c["text"] for c in got) == want_text
    assert got[-1]["worker_id"] == "worker-1" and got[-1]["usage"] == want_last["usage"]
    assert a.engine.stats()["migration_moved_out"] >= 1
    assert b.engine.stats()["migration_moved_in"] >= 1
    wait_clean(a, b)


def test_failed_move_goes_back_to_its_source(pair):
    a, b = pair

    async def run():
        want = await _whole(a, "ref2")
        gen, got = await _held_mid_stream(a, "back", 3)
        try:
            _, data = await a.export_stream("back")
            bad = msgpack.unpackb(data, raw=False)
            bad["model"]["num_layers"] += 1  # another geometry: refused, nothing kept
            res = await b.import_stream(msgpack.packb(bad, use_bin_type=True))
            assert "error" in res and "model" in res["error"]
            assert (await a.import_stream(data)) == {"request_id": "back"}  # rolled back
        finally:
            a.engine.unpause()
        got += [c async for c in gen]
        return want, got

    (want_ids, want_text, _), got = asyncio.run(run())
    assert [t for c in got for t in c["token_ids"]] == want_ids
    assert "".join(c["text"] for c in got) == want_text
    assert all("moved_to" not in c for c in got) and got[-1]["worker_id"] == "worker-0"
    wait_clean(a, b)


def test_abort_racing_a_move_leaves_nothing(pair):
    a, b = pair

    async def run():
        gen, _ = await _held_mid_stream(a, "race", 2)
        try:
            _, data = await a.export_stream("race")
            assert "request_id" in await b.import_stream(data)
            await gen.aclose()  # the client leaves while the stream is in transit
            deadline = time.monotonic() + 30
            while "race" in a.engine._moving:  # its abort reached the engine's step thread
                assert time.monotonic() < deadline, "the abort never reached the engine"
                await asyncio.sleep(0.01)
            assert not await a.hand_over("race", 1)  # its consumer is gone: the move is off
            await b.abort("race")  # what the router does then
        finally:
            a.engine.unpause()

    asyncio.run(run())
    wait_clean(a, b)
