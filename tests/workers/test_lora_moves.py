"""A LoRA stream moved live between two WorkerActor bodies in-process (tiny model, no Ray),
by the router's own protocol: the target, which has not loaded the adapter, loads it from
where the source did, the stream keeps its adapter (PEFT's tokens) and its KV keeps the
adapter's hash chain there; a target whose slots are all held by running streams of other
adapters refuses, and the stream goes on at its source."""

from __future__ import annotations

import asyncio
import time

import pytest
from lora_adapters import make_adapter, peft_greedy
from tiny_models import tiny_model_path

from kvserve.kvcache.hashing import hash_full_blocks
from kvserve.router.live_move import LiveMoveConfig, LocalWorker, MoveFailed, live_move
from kvserve.workers.worker_actor import WorkerActor

PROMPT = [5, 17, 300, 42, 99, 1000, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
N = 40
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
ENGINE = {"num_threads": 1, "kv_cache_tokens": 1024, "max_model_len": 256, "block_size": 4,
          "host_cache_gib": 0.01, "enable_lora": True, "max_loras": 1}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tiny_model_path(tmp_path_factory)
    root = tmp_path_factory.mktemp("move_loras")
    loras = {"x": make_adapter(base, str(root / "x"), 8, seed=21),
             "y": make_adapter(base, str(root / "y"), 4, seed=22)}
    want = peft_greedy(base, loras, [PROMPT], N)
    a = WorkerActor("worker-0", {**ENGINE, "model": base, "loras": {"x": loras["x"]}})
    b = WorkerActor("worker-1", {**ENGINE, "model": base, "loras": {"y": loras["y"]}})
    yield a, b, loras, want
    a.engine.shutdown()
    b.engine.shutdown()


async def held(w: WorkerActor, rid: str, lora: str, steps: int):
    await w.engine.pause()
    gen = w.generate(rid, PROMPT, GREEDY, None, lora)
    first = asyncio.ensure_future(gen.__anext__())
    deadline = time.monotonic() + 30
    while rid not in w.engine.unfinished_ids():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    for _ in range(steps):
        await w.engine.step()
    return gen, [await first]


def tokens(chunks: list[dict]) -> list[int]:
    return [t for c in chunks for t in c["token_ids"]]


def wait_clean(*workers: WorkerActor) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        engines = [w.engine.engine for w in workers]
        if all(e.kv.pool.num_used == 0 and not e.seqs and not e.kv.reserved for e in engines):
            for e in engines:
                e.check_invariants()
                for ad in [*e.adapters.by_name.values(), *e.adapters.host.values()]:
                    assert ad.users == 0 and ad.running == 0
            return
        time.sleep(0.05)
    raise AssertionError([w.engine.stats() for w in workers])


def test_a_lora_stream_moves_live_and_the_target_loads_its_adapter(setup):
    a, b, loras, want = setup

    async def run():
        gen, got = await held(a, "m1", "x", 6)
        try:
            res = await live_move(LocalWorker(a, "worker-0"), LocalWorker(b, "worker-1"), 1,
                                  "m1", LiveMoveConfig())
        finally:
            a.engine.unpause()
        rest = [c async for c in gen]
        assert rest[-1] == {"moved_to": 1, "worker_id": "worker-0"}
        # the stream's KV arrived under the adapter's chain: full blocks of its own root
        eng = b.engine.engine
        seq = eng.seqs["m1"]
        root = seq.lora.root
        assert root != 0 and seq.lora.name == "x"
        state = eng.kv.stream("m1")
        n = len(state.block_hashes)
        assert n > 0 and state.block_hashes == hash_full_blocks(
            seq.all_ids[: n * 4], 4, parent=root)
        got += rest[:-1]
        got += [c async for c in b.resume("m1")]
        return got, res

    got, res = asyncio.run(run())
    assert tokens(got) == want["x"][0]
    assert res.rounds >= 1 and got[-1]["worker_id"] == "worker-1"
    assert "x" in {x["name"] for x in b.list_loras()}  # loaded there from the source's path
    wait_clean(a, b)
    assert b.remove_lora("x") == {"removed": "x"}


def test_a_target_without_a_free_slot_refuses_and_the_stream_stays(setup):
    a, b, loras, want = setup

    async def run():
        await b.engine.pause()  # b's only slot held by a running stream of adapter y
        other = b.generate("busy", PROMPT, GREEDY, None, "y")
        first_b = asyncio.ensure_future(other.__anext__())
        while "busy" not in b.engine.unfinished_ids():
            await asyncio.sleep(0.01)
        await b.engine.step()
        gen, got = await held(a, "m2", "x", 3)
        try:
            with pytest.raises(MoveFailed, match="no LoRA slot free") as e:
                await live_move(LocalWorker(a, "worker-0"), LocalWorker(b, "worker-1"), 1,
                                "m2", LiveMoveConfig())
            assert e.value.refused
        finally:
            a.engine.unpause()
            b.engine.unpause()
        got += [c async for c in gen]
        busy = [await first_b] + [c async for c in other]
        return got, busy

    got, busy = asyncio.run(run())
    assert tokens(got) == want["x"][0] and got[-1]["worker_id"] == "worker-0"
    assert tokens(busy) == want["y"][0]
    wait_clean(a, b)
    b.remove_lora("x")
