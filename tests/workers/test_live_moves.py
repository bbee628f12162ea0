"""Live moves between two WorkerActor bodies in-process (real engines on a tiny random Llama
with SmolLM2's tokenizer, no Ray), driven by the router's own protocol (`router/live_move.py`) or call by call: the stream
keeps decoding on its source during the pre-copy rounds, its consumer reads every token once,
and the output is the unmoved run's (greedy, seeded sampling, logprobs, stop strings, a JSON
schema). Refusals and failures leave both engines clean."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from engine_runs import held_mid_stream
from tiny_models import tiny_model_path

from kvserve.router.live_move import LiveMoveConfig, LocalWorker, MoveFailed, live_move
from kvserve.workers.worker_actor import WorkerActor

ENGINE = {"num_threads": 1, "kv_cache_tokens": 2048, "max_model_len": 512}
PROMPT = ("The history of the printing press begins in the fifteenth century, when a "
          "goldsmith in Mainz combined several existing techniques into one workshop")
GREEDY = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    engine = {**ENGINE, "model": tiny_model_path(tmp_path_factory)}
    a, b = WorkerActor("worker-0", engine), WorkerActor("worker-1", engine)
    yield a, b
    a.engine.shutdown()
    b.engine.shutdown()


def ids(w: WorkerActor) -> list[int]:
    return w.engine.tokenizer.encode(PROMPT)


def wait_clean(*workers: WorkerActor) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        eng = [w.engine for w in workers]
        if all(e.stats()["kv_blocks_used"] == 0 and not e.unfinished_ids()
               and not e.engine.kv.reserved and not e.engine.kv.held
               and e.live_moves() == {"out": [], "in": []} for e in eng):
            for e in eng:
                e.engine.check_invariants()
            return
        time.sleep(0.05)
    raise AssertionError([(w.engine.stats(), w.engine.live_moves()) for w in workers])


async def whole(w: WorkerActor, rid: str, params: dict) -> list[dict]:
    return [c async for c in w.generate(rid, ids(w), params)]


async def held(w: WorkerActor, rid: str, params: dict, steps: int) -> tuple[object, list[dict]]:
    """`rid` started on `w` with its engine held after `steps` steps; its first chunk read."""
    return await held_mid_stream(w, rid, ids(w), params, steps)


def joined(chunks: list[dict]) -> tuple[list[int], str]:
    return [t for c in chunks for t in c["token_ids"]], "".join(c["text"] for c in chunks)


async def moved_run(a: WorkerActor, b: WorkerActor, rid: str, params: dict, steps: int,
                    running: bool = False) -> tuple[list[dict], object]:
    """Start `rid` on `a`, move it live to `b` after `steps` steps (`running`: while `a` keeps
    stepping; else with `a` held, so the move lands at that point of the stream whatever the
    machine's speed), read it to its end."""
    gen, got = await held(a, rid, params, steps)
    if running:
        a.engine.unpause()
    try:
        res = await live_move(LocalWorker(a, "worker-0"), LocalWorker(b, "worker-1"), 1, rid,
                              LiveMoveConfig())
    finally:
        a.engine.unpause()
    rest = [c async for c in gen]
    assert rest[-1] == {"moved_to": 1, "worker_id": "worker-0"}
    got += rest[:-1]
    got += [c async for c in b.resume(rid)]
    return got, res


@pytest.mark.parametrize("params", [
    GREEDY,
    {"max_tokens": 48, "temperature": 0.9, "top_p": 0.95, "seed": 7, "ignore_eos": True},
    {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 3},
], ids=["greedy", "seeded", "logprobs"])
def test_live_moved_stream_is_the_unmoved_one(pair, params):
    a, b = pair

    async def run():
        want = await whole(a, "ref", params)
        got, res = await moved_run(a, b, "live", params, 4)
        return want, got, res

    want, got, res = asyncio.run(run())
    assert joined(got) == joined(want)
    # prompt and completion tokens (the reference run's prompt is a prefix hit for this one)
    assert got[-1]["usage"][::2] == want[-1]["usage"][::2] and got[-1]["worker_id"] == "worker-1"
    if "logprobs" in params:
        assert [x for c in got for x in c["logprobs"]] == [x for c in want for x in c["logprobs"]]
        assert [x for c in got for x in c["top_logprobs"]] == [
            x for c in want for x in c["top_logprobs"]]
    assert res.rounds >= 2 and res.bytes > 0 and res.stall_s > 0
    wait_clean(a, b)


def test_a_stream_moved_while_its_source_runs_is_the_unmoved_one(pair):
    """The router's protocol against a source that keeps stepping: rounds come between its
    steps (an answer as long as the context allows: the move, a few rounds of one step each,
    ends hundreds of steps before the stream does)."""
    a, b = pair
    params = {**GREEDY, "max_tokens": 512 - len(ids(a))}

    async def run():
        want = await whole(a, "ref", params)
        got, res = await moved_run(a, b, "free", params, 4, running=True)
        return want, got, res

    want, got, res = asyncio.run(run())
    assert joined(got) == joined(want) and got[-1]["worker_id"] == "worker-1"
    assert res.rounds >= 2
    wait_clean(a, b)


def test_precopy_rounds_follow_the_stream_as_it_decodes(pair):
    """Call by call, one block a round with a step of the source between rounds: the blocks
    the stream fills during the rounds go over in later rounds; the final stage sends only
    what is left (a few blocks) and the output is the unmoved one."""
    a, b = pair

    async def run():
        want = await whole(a, "ref", GREEDY)
        gen, got = await held(a, "steps", GREEDY, 2)
        try:
            info = await a.live_begin("steps", "worker-1")
            assert info["tokens"] > 16 and "error" not in info
            assert (await b.live_reserve(info, 64))["blocks"] >= (info["tokens"] + 64) // 16
            rounds, first_tokens = 0, info["tokens"]
            while True:
                meta, data = await a.live_round("steps", 0.02, 1)
                assert "error" not in meta
                if meta["blocks"]:
                    assert (await b.live_write("steps", meta, data))["written"] == \
                        meta["first"] + meta["blocks"]
                rounds += 1
                if meta["left"] == 0 and meta["tokens"] >= first_tokens + 24:
                    break
                await a.engine.step()  # the stream decodes between rounds
            meta, data = await a.live_freeze("steps")
            assert meta["blocks"] <= 2  # the partial tail (and a block filled meanwhile)
            assert meta["tokens"] >= first_tokens + 24
            assert (await b.live_commit("steps", meta, data)) == {"request_id": "steps"}
            assert await a.live_finish("steps", 1)
        finally:
            a.engine.unpause()
        rest = [c async for c in gen]
        got += rest[:-1]
        got += [c async for c in b.resume("steps")]
        return want, got, rounds

    want, got, rounds = asyncio.run(run())
    assert rounds > 3
    assert joined(got) == joined(want)
    wait_clean(a, b)


def test_stop_strings_and_a_json_schema_survive_a_live_move(pair):
    a, b = pair
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "year": {"type": "integer"}},
              "required": ["name", "year"], "additionalProperties": False}
    structured = {"max_tokens": 60, "temperature": 0,
                  "structured": {"type": "json_schema", "spec": json.dumps(schema)}}
    stops = {"max_tokens": 60, "temperature": 0, "stop": ["printing", "\n\n"]}
    # (the source is held for the move: a stop string may come early in the output)

    async def run():
        out = []
        for i, p in enumerate((structured, stops)):
            want = await whole(a, f"ref{i}", p)
            got, _ = await moved_run(a, b, f"mv{i}", p, 3)
            out.append((want, got))
        return out

    for want, got in asyncio.run(run()):
        assert joined(got) == joined(want)
        assert got[-1]["finish_reason"] == want[-1]["finish_reason"]
    wait_clean(a, b)


def test_a_target_without_room_refuses_and_the_stream_stays(pair):
    a, b = pair

    async def run():
        want = await whole(a, "ref", GREEDY)
        # the target's pool taken by a reservation of its own: no room for the stream
        kv = b.engine.engine.kv
        free = kv.num_free_blocks
        await b.engine._call(lambda: kv.reserve_blocks("hog", free - 2))
        gen, got = await held(a, "norooom", GREEDY, 3)
        a.engine.unpause()
        try:
            with pytest.raises(MoveFailed, match="no room for the stream") as e:
                await live_move(LocalWorker(a, "worker-0"), LocalWorker(b, "worker-1"), 1,
                                "norooom", LiveMoveConfig())
            assert e.value.refused
        finally:
            await b.engine._call(lambda: kv.release_reservation("hog"))
        got += [c async for c in gen]
        return want, got

    want, got = asyncio.run(run())
    assert joined(got) == joined(want) and got[-1]["worker_id"] == "worker-0"
    wait_clean(a, b)


def test_a_stream_that_finishes_during_precopy_ends_and_frees_the_reservation(pair):
    a, b = pair

    async def run():
        gen, got = await held(a, "fin", {**GREEDY, "max_tokens": 6}, 1)
        info = await a.live_begin("fin", "worker-1")
        await b.live_reserve(info, 64)
        meta, data = await a.live_round("fin", 0.02, 1)
        await b.live_write("fin", meta, data)
        while "fin" in a.engine.unfinished_ids():  # it runs to its end on the source
            await a.engine.step()
        a.engine.unpause()
        got += [c async for c in gen]
        meta, _ = await a.live_round("fin", 0.02, 1)
        assert "finished or was aborted" in meta["error"] or "not moving" in meta["error"]
        assert await b.live_cancel("fin")  # what the router does then
        return got

    got = asyncio.run(run())
    assert got[-1]["finish_reason"] == "length" and len(joined(got)[0]) == 6
    wait_clean(a, b)


def test_cancel_during_the_final_stage_ends_the_move(pair):
    """The client leaves while its stream is frozen: the source frees it, the finish finds
    no consumer, and the router aborts the target's copy."""
    a, b = pair

    async def run():
        gen, _ = await held(a, "gone", GREEDY, 3)
        info = await a.live_begin("gone", "worker-1")
        await b.live_reserve(info, 64)
        while True:
            meta, data = await a.live_round("gone", 0.02, 8)
            if meta["blocks"]:
                await b.live_write("gone", meta, data)
            if meta["left"] == 0:
                break
        meta, data = await a.live_freeze("gone")
        await gen.aclose()  # the client leaves
        deadline = time.monotonic() + 30
        while "gone" in a.engine._moving:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert (await b.live_commit("gone", meta, data)) == {"request_id": "gone"}
        assert not await a.live_finish("gone", 1)
        await b.abort("gone")
        a.engine.unpause()

    asyncio.run(run())
    wait_clean(a, b)


def test_a_target_that_fails_at_commit_gives_the_stream_back(pair):
    """A commit the target cannot take (its record tampered: another model) is refused; the
    source thaws the stream and it finishes there with the unmoved output."""
    a, b = pair

    async def run():
        want = await whole(a, "ref", GREEDY)
        gen, got = await held(a, "thaw", GREEDY, 3)
        info = await a.live_begin("thaw", "worker-1")
        await b.live_reserve(info, 64)
        meta, data = await a.live_freeze("thaw")
        meta["record"]["model"] = {**meta["record"]["model"], "num_layers": 99}
        res = await b.live_commit("thaw", meta, data)
        assert "error" in res and "model" in res["error"]
        assert await a.live_abandon("thaw")  # thawed: the same consumer reads on
        a.engine.unpause()
        got += [c async for c in gen]
        return want, got

    want, got = asyncio.run(run())
    assert joined(got) == joined(want) and got[-1]["worker_id"] == "worker-0"
    wait_clean(a, b)
