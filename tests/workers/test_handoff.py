"""Hand-offs after prefill (disaggregated serving) between two WorkerActor bodies in-process
(real engines on a tiny random Llama with SmolLM2's tokenizer, no Ray), driven by the
router's own protocol (`router/handoff.py`): the decode worker reserves room first, the
prefill worker runs the prompt, sends the first token at once and holds the stream, which
is then frozen, committed on the decode worker and released. The client's stream is the
one a single worker gives (greedy, seeded sampling, logprobs); the decode worker computes
no prompt token. A copy that fails is recomputed on the decode worker or fails the request,
by the policy; leases free what nobody comes for; both engines are clean after each test.
Tensor-parallel sizes that differ between the roles (2 and 1, CPU gloo) hand off too."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tiny_models import make_tiny_hf_model, tiny_model_path

from kvserve.router.handoff import HandoffConfig, hand_off, reservation, reserve
from kvserve.router.live_move import LocalWorker, MoveFailed
from kvserve.workers.worker_actor import WorkerActor

ENGINE = {"num_threads": 1, "kv_cache_tokens": 2048, "max_model_len": 512}
PROMPT = ("The history of the printing press begins in the fifteenth century, when a "
          "goldsmith in Mainz combined several existing techniques into one workshop")
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    engine = {**ENGINE, "model": tiny_model_path(tmp_path_factory)}
    a = WorkerActor("worker-0", engine, role="prefill")
    b = WorkerActor("worker-1", engine, role="decode")
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
               and e.live_moves() == {"out": [], "in": []}
               and e.handoffs() == {"prefilling": [], "held": []} for e in eng):
            for e in eng:
                e.engine.check_invariants()
            return
        time.sleep(0.05)
    raise AssertionError([(w.engine.stats(), w.engine.live_moves(), w.engine.handoffs())
                          for w in workers])


def joined(chunks: list[dict]) -> tuple[list[int], str]:
    assert all("token_ids" in c for c in chunks), chunks  # (an error or marker among them)
    return [t for c in chunks for t in c["token_ids"]], "".join(c["text"] for c in chunks)


async def whole(w: WorkerActor, rid: str, params: dict) -> list[dict]:
    return [c async for c in w.generate(rid, ids(w), params)]


async def prefilled(a: WorkerActor, b: WorkerActor, rid: str, params: dict,
                    cfg: HandoffConfig) -> asyncio.Task:
    """`rid` reserved on `b`, then started on `a` for a hand-off; the task reads its chunks
    on `a` (to its `moved_to`, or its error)."""
    info = reservation(rid, len(ids(a)), len(ids(a)) + params["max_tokens"], a.info()["kv"])
    await reserve(LocalWorker(b, "worker-1"), info, cfg)

    async def read() -> list[dict]:
        return [c async for c in a.generate(rid, ids(a), params, handoff=True)]

    return asyncio.ensure_future(read())


async def handed(a: WorkerActor, b: WorkerActor, rid: str, params: dict,
                 cfg: HandoffConfig | None = None) -> tuple[list[dict], list[dict], object]:
    cfg = cfg or HandoffConfig()
    reading = await prefilled(a, b, rid, params, cfg)
    res = await hand_off(LocalWorker(a, "worker-0"), LocalWorker(b, "worker-1"), 1, rid, cfg)
    on_a = await reading
    on_b = [c async for c in b.resume(rid)] if on_a[-1].get("moved_to") == 1 else []
    return on_a, on_b, res


@pytest.mark.parametrize("params", [
    GREEDY,
    {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 7, "ignore_eos": True},
    {"max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 3},
], ids=["greedy", "seeded", "logprobs"])
def test_a_handed_off_stream_is_the_single_worker_one(pair, params):
    a, b = pair

    async def run():
        want = await whole(b, "ref", params)
        b.engine.engine.kv.reset_prefix_cache()  # the decode worker must not hit the prompt
        on_a, on_b, res = await handed(a, b, "ho", params)
        return want, on_a, on_b, res

    want, on_a, on_b, res = asyncio.run(run())
    # the prefill worker sent the first token, and only that, then the stream moved
    assert on_a[0]["token_ids"] == joined(want)[0][:1] and on_a[0]["worker_id"] == "worker-0"
    assert on_a[-1] == {"moved_to": 1, "worker_id": "worker-0"}
    assert len(joined(on_a[:-1])[0]) == 1
    got = on_a[:-1] + on_b
    assert joined(got) == joined(want)
    assert got[-1]["usage"][::2] == want[-1]["usage"][::2] and got[-1]["worker_id"] == "worker-1"
    if "logprobs" in params:
        assert [x for c in got for x in c["logprobs"]] == [x for c in want for x in c["logprobs"]]
    assert res.outcome == "moved" and res.bytes > 0 and res.dst == 1
    assert res.tokens == len(ids(a))  # the prompt's KV went over, nothing else
    assert b.engine.stats()["handoffs_in"] >= 1 and a.engine.stats()["handoffs_out"] >= 1
    assert b.engine.stats()["tokens_recomputed"] == 0
    wait_clean(a, b)


def test_the_decode_worker_computes_no_prompt_token(pair):
    """The KV came with the stream: the decode worker's prefix cache misses the prompt and
    its prefill counter grows only by the decode steps' tokens."""
    a, b = pair

    async def run():
        b.engine.engine.kv.reset_prefix_cache()
        before = b.engine.engine.prompt_tokens_computed
        on_a, on_b, res = await handed(a, b, "count", GREEDY)
        return b.engine.engine.prompt_tokens_computed - before, on_a, on_b, res

    computed, on_a, on_b, res = asyncio.run(run())
    assert res.outcome == "moved"
    made = len(joined(on_b)[0])
    assert computed == made  # one token in per decode step (the first one's, then its own)
    wait_clean(a, b)


def test_a_handoff_does_not_wait_for_the_prefill_workers_step_under_way(pair):
    """The prefill worker's step thread stays busy from the moment the hand-off request is
    held (as under the next prompt's long prefill step): the freeze (read as it was held)
    and the release (the consumer told at once, the blocks freed between steps) need no
    step boundary there, so the stream reaches its decode worker and finishes meanwhile."""
    a, b = pair
    gate, entered = threading.Event(), threading.Event()
    hold = a.engine._hold_handoffs

    def hold_then_stay_busy(outs):  # the step thread
        hold(outs)
        if "fast" in a.engine.handoffs()["held"] and not gate.is_set():
            entered.set()
            gate.wait(60)

    async def run():
        want = await whole(b, "ref fast", GREEDY)
        b.engine.engine.kv.reset_prefix_cache()
        a.engine._hold_handoffs = hold_then_stay_busy
        cfg = HandoffConfig()
        reading = await prefilled(a, b, "fast", GREEDY, cfg)
        res = await asyncio.wait_for(
            hand_off(LocalWorker(a, "worker-0"), LocalWorker(b, "worker-1"), 1, "fast", cfg),
            30)
        on_a = await asyncio.wait_for(reading, 30)
        on_b = [c async for c in b.resume("fast")]
        busy = entered.is_set() and not gate.is_set()
        gate.set()
        return want, on_a, on_b, res, busy

    try:
        want, on_a, on_b, res, busy = asyncio.run(run())
    finally:
        gate.set()
        del a.engine._hold_handoffs  # (the instance's own; the class's again)
    assert busy  # the whole hand-off ran while the prefill worker's step thread was busy
    assert res.outcome == "moved", res
    assert joined(on_a[:-1] + on_b) == joined(want)
    wait_clean(a, b)


def test_a_request_its_first_token_ends_needs_no_handoff(pair):
    a, b = pair

    async def run():
        return await handed(a, b, "one", {**GREEDY, "max_tokens": 1})

    on_a, on_b, res = asyncio.run(run())
    assert res.outcome == "finished" and on_b == []
    assert on_a[-1]["finish_reason"] == "length" and len(joined(on_a)[0]) == 1
    wait_clean(a, b)  # the decode worker's reservation was freed


def test_a_wait_that_comes_after_the_request_ended_learns_it_at_once(pair):
    """The router's wait may reach the prefill worker after a short request has ended
    there (its first token ended it): the wait answers at once, not after its timeout."""
    a, b = pair

    async def run():
        chunks = [c async for c in a.generate("late", ids(a), {**GREEDY, "max_tokens": 1},
                                              handoff=True)]
        t0 = time.monotonic()
        got = await a.engine.handoff_wait("late", 30.0)
        return chunks, got, time.monotonic() - t0

    chunks, got, waited = asyncio.run(run())
    assert chunks[-1]["finish_reason"] == "length"
    assert got == {"finished": True} and waited < 5.0
    wait_clean(a, b)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_copy_is_recomputed_or_fails_the_request(pair, policy):
    """The decode worker's reservation is gone when the stream comes (its lease ran out):
    the commit fails. Under `recompute` the stream's state goes over without KV and the
    decode worker recomputes it (the output is the single-worker one); under `fail` the
    request ends with UNAVAILABLE after its first token. Nothing is left reserved or held."""
    a, b = pair
    cfg = HandoffConfig(failure_policy=policy)

    async def run():
        want = await whole(b, "ref", GREEDY)
        reading = await prefilled(a, b, f"lost-{policy}", GREEDY, cfg)
        assert await b.live_cancel(f"lost-{policy}")  # as its lease would
        res = await hand_off(LocalWorker(a, "worker-0"), LocalWorker(b, "worker-1"), 1,
                             f"lost-{policy}", cfg)
        on_a = await reading
        on_b = [c async for c in b.resume(f"lost-{policy}")] \
            if on_a[-1].get("moved_to") == 1 else []
        return want, on_a, on_b, res

    want, on_a, on_b, res = asyncio.run(run())
    assert "no reservation" in res.error
    if policy == "recompute":
        assert res.outcome == "recomputed" and res.dst == 1
        assert joined(on_a[:-1] + on_b) == joined(want)
        assert on_b[-1]["worker_id"] == "worker-1"
    else:
        assert res.outcome == "failed" and on_b == []
        assert len(joined(on_a[:-1])[0]) == 1  # the first token came, then the error
        assert on_a[-1]["error"] == "unavailable" and "hand-off" in on_a[-1]["message"]
        assert a.engine.stats()["handoffs_failed"] >= 1
    wait_clean(a, b)


def test_leases_free_a_held_stream_and_a_reservation_nobody_comes_for(pair):
    """No router comes: the decode worker frees its reservation after its lease, and the
    prefill worker fails the held stream after its own (blocks freed, UNAVAILABLE)."""
    a, b = pair
    old = a.handoff_lease_s

    async def run():
        a.handoff_lease_s = 0.5
        info = reservation("orphan", len(ids(a)), len(ids(a)) + 24, a.info()["kv"])
        assert (await b.live_reserve(info, 64, 0.5))["blocks"] > 0
        chunks = [c async for c in a.generate("orphan", ids(a), GREEDY, handoff=True)]
        return chunks

    try:
        chunks = asyncio.run(run())
    finally:
        a.handoff_lease_s = old
    assert len(joined(chunks[:-1])[0]) == 1
    assert chunks[-1]["error"] == "unavailable" and "did not come within" in chunks[-1]["message"]
    assert a.engine.stats()["handoffs_leases_expired"] >= 1
    wait_clean(a, b)


def test_a_client_that_leaves_while_held_ends_the_handoff(pair):
    a, b = pair
    cfg = HandoffConfig()

    async def run():
        info = reservation("left", len(ids(a)), len(ids(a)) + 24, a.info()["kv"])
        await reserve(LocalWorker(b, "worker-1"), info, cfg)
        gen = a.generate("left", ids(a), GREEDY, handoff=True)
        first = await gen.__anext__()
        deadline = time.monotonic() + 30
        while a.engine.handoffs()["held"] != ["left"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await gen.aclose()  # the client leaves: the held stream is aborted
        # at once, not when the closed generators are collected: the engine's abort is queued
        # before the hand-off's first call, so the hand-off finds the stream gone
        assert "left" not in a._requests
        res = await hand_off(LocalWorker(a, "worker-0"), LocalWorker(b, "worker-1"), 1,
                             "left", cfg)
        return first, res

    first, res = asyncio.run(run())
    assert len(first["token_ids"]) == 1 and res.outcome == "gone"
    wait_clean(a, b)


def test_a_decode_worker_without_room_refuses_the_reservation(pair):
    a, b = pair

    async def run():
        kv = b.engine.engine.kv
        free = kv.num_free_blocks
        await b.engine._call(lambda: kv.reserve_blocks("hog", free - 2))
        try:
            info = reservation("full", len(ids(a)), len(ids(a)) + 24, a.info()["kv"])
            with pytest.raises(MoveFailed, match="no room") as e:
                await reserve(LocalWorker(b, "worker-1"), info, HandoffConfig())
            assert e.value.refused
        finally:
            await b.engine._call(lambda: kv.release_reservation("hog"))

    asyncio.run(run())
    wait_clean(a, b)


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory):
    """A tensor-parallel prefill worker (size 2, gloo, its host tier staging the blocks) and
    a single-device decode worker, on a tiny Llama with two KV heads."""
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tp_handoff"), "llama", seed=5,
                              num_key_value_heads=2)
    engine = {**ENGINE, "model": path, "dtype": "float32", "host_cache_gib": 0.01}
    a = WorkerActor("worker-0", {**engine, "tensor_parallel_size": 2}, role="prefill")
    b = WorkerActor("worker-1", engine, role="decode")
    yield a, b
    a.engine.shutdown()
    b.engine.shutdown()


@pytest.mark.slow  # (its gloo pair costs ~12 s; tests/deploy/test_disagg_tp_cluster.py: via Ray)
@pytest.mark.parametrize("direction", ["2 to 1", "1 to 2"])
def test_handoffs_between_tensor_parallel_sizes(tp_pair, direction):
    """A prompt prefilled on a size-2 worker decodes on a size-1 worker, and the other way:
    the hand-off carries whole KV heads; the tokens are a single worker's."""
    a, b = tp_pair if direction == "2 to 1" else tp_pair[::-1]

    async def run():
        want = await whole(b, f"ref {direction}", GREEDY)
        b.engine.engine.kv.reset_prefix_cache()
        on_a, on_b, res = await handed(a, b, f"tp {direction}", GREEDY)
        return want, on_a, on_b, res

    want, on_a, on_b, res = asyncio.run(run())
    assert res.outcome == "moved", res
    assert joined(on_a[:-1] + on_b) == joined(want)
    assert b.engine.stats()["tokens_recomputed"] == 0
    wait_clean(a, b)
