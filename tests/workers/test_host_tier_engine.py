"""The host tier end to end (tiny random model, real tokenizer): in-flight write-backs are never overwritten, parked
streams move between engines as msgpack snapshots, aborting a parked stream frees its host
blocks, and a follow-up turn whose history left the device is served from host by copy."""

from __future__ import annotations

import msgpack
import pytest
import torch
from engine_runs import run_to_end
from tiny_models import tiny_model_path

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kvcache.hashing import hash_full_blocks
from kvserve.workers.engine.engine import LLMEngine

BS = 4


@pytest.fixture(scope="module")
def smol_path(tmp_path_factory) -> str:
    # the default model is 20-50x slower per step on a loaded 2-core machine
    return tiny_model_path(tmp_path_factory)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


run_all = run_to_end


def assert_clean(eng: LLMEngine) -> None:
    eng.check_invariants()
    assert eng.kv.streams == {} and eng.kv.held == {} and eng.kv.pool.num_used == 0
    assert eng.kv.host is None or eng.kv.host.num_used == 0


def engine(path: str, tokens: int, host_gib: float, **kw) -> LLMEngine:
    # copies forced: these tests check what comes back by copy, whatever this machine's speed
    kw.setdefault("host_restore_policy", "copy")
    return LLM(path, kv_cache_tokens=tokens, block_size=BS, host_cache_gib=host_gib, **kw).engine


@pytest.fixture(scope="module")
def ref(smol_path) -> LLM:
    return LLM(smol_path, kv_cache_tokens=4096, block_size=BS, host_cache_gib=0)


def test_inflight_writeback_blocks_are_not_reused(smol_path, ref):
    # streams of different lengths, so an eviction sometimes lets the step go on while the
    # victim's copy is still in flight, and sometimes the step must wait for it
    ps = [p[: 9 + 6 * i] for i, p in enumerate(prompts(6, 40, seed=11))]
    want = [o.token_ids for o in ref.generate(ps, greedy(20))]
    eng = engine(smol_path, 18 * BS, 0.001, admission_lookahead_tokens=0)
    host = eng.kv.host
    assert host is not None
    host.copier.delay_s = 0.15  # every write-back reads the device 0.15 s after it was issued
    inflight_allocs = 0
    allocate = eng.kv.pool.allocate

    def checked_allocate(n: int, after: int | None = None) -> list[int]:
        nonlocal inflight_allocs
        busy = {b for s in eng.scheduler.inflight if s.parked_kv and s.parked_kv.transfer
                and not s.parked_kv.transfer.done() for b in eng.kv.held.get(s.request_id, [])}
        inflight_allocs += bool(busy)
        out = allocate(n, after)
        assert not busy & set(out), "a block whose write-back is in flight was handed out"
        return out

    eng.kv.pool.allocate = checked_allocate  # type: ignore[method-assign]
    ids = [eng.add_request(p, greedy(20)) for p in ps]
    got = run_all(eng)
    # had a block been reused before its delayed copy read it, the host copy would hold the
    # new stream's KV and the restored stream's output would differ
    assert [got[i] for i in ids] == want
    assert eng.stats()["evictions"] > 0
    assert inflight_allocs > 0, "no step ran during a write-back: the ordering was not tested"
    s = eng.stats()
    assert s["evictions"] > 0 and s["tokens_restored_copy"] > 0
    assert_clean(eng)


def _running_engine(smol_path: str, host_gib: float = 0.001) -> tuple[LLMEngine, str, list[int]]:
    eng = engine(smol_path, 1024, host_gib)
    p = prompts(1, 37, seed=5)[0]
    rid = eng.add_request(p, greedy(30), request_id="moving")
    seen: list[int] = []
    while len(seen) < 11:
        for o in eng.step():
            seen.extend(o.delta_token_ids)
    return eng, rid, seen


@pytest.mark.parametrize("target_host_gib", [0.001, 0.0])
def test_snapshot_resumes_in_another_engine(smol_path, ref, target_host_gib):
    p = prompts(1, 37, seed=5)[0]
    want = ref.generate(p, greedy(30))[0].token_ids
    src, rid, seen = _running_engine(smol_path)
    data = src.export_stream(rid)
    assert isinstance(data, bytes) and rid not in src.seqs
    assert_clean(src)  # the stream left: nothing of it stays pinned
    record = msgpack.unpackb(data, raw=False)
    assert record["output_ids"] == seen and record["kv"]["tokens"] == 37 + len(seen) - 1
    dst = engine(smol_path, 512, target_host_gib)
    assert dst.import_stream(data) == rid
    assert dst.stats()["parked"] == 1
    out = None
    while dst.has_unfinished():
        for o in dst.step():
            assert o.request_id == rid
            out = o
    assert out is not None and out.token_ids == want and out.finish_reason == "length"
    s = dst.stats()
    if target_host_gib:
        # everything but the last sampled token came over by copy: nothing recomputed
        assert s["tokens_restored_copy"] == record["kv"]["tokens"] and s["tokens_recomputed"] == 0
    else:
        assert s["tokens_recomputed"] == record["kv"]["tokens"]
    assert_clean(dst)


def test_snapshot_keeps_seeded_sampling_and_text(smol_path):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    p = "Once upon a time in a small village,"
    solo = LLM(smol_path, kv_cache_tokens=1024, block_size=BS, host_cache_gib=0)
    whole = solo.generate(p, params)[0]
    eng = solo.engine
    rid = eng.add_request(p, params)
    streamed = ""
    n = 0
    while n < 9:
        for o in eng.step():
            streamed += o.delta_text
            n += len(o.delta_token_ids)
    other = engine(smol_path, 1024, 0.001)
    other.import_stream(eng.export_stream(rid))
    last = None
    while other.has_unfinished():
        for o in other.step():
            streamed += o.delta_text
            last = o
    assert last is not None and last.token_ids == whole.token_ids
    assert last.text == whole.text and streamed == whole.text


def test_bad_snapshots_are_rejected(smol_path, tmp_path):
    eng = engine(smol_path, 512, 0.001)
    with pytest.raises(InvalidRequestError, match="bad stream snapshot"):
        eng.import_stream(b"\x00not msgpack")
    with pytest.raises(InvalidRequestError, match="bad stream snapshot"):
        eng.import_stream(msgpack.packb({"version": 99}))
    with pytest.raises(InvalidRequestError, match="no unfinished request"):
        eng.export_stream("nope")
    src, rid, _ = _running_engine(smol_path)
    record = msgpack.unpackb(src.export_stream(rid), raw=False)
    good = msgpack.packb(record, use_bin_type=True)
    record["model"]["num_layers"] += 1
    with pytest.raises(InvalidRequestError, match="model"):
        eng.import_stream(msgpack.packb(record, use_bin_type=True))
    assert not eng.has_unfinished()
    assert_clean(eng)
    # the same stream twice: the second import is refused and pins nothing
    eng.import_stream(good)
    pinned = eng.kv.host.num_used if eng.kv.host else 0
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.import_stream(good)
    assert (eng.kv.host.num_used if eng.kv.host else 0) == pinned
    run_all(eng)
    assert_clean(eng)


def test_abort_parked_stream_frees_host_blocks(smol_path):
    eng, rid, _ = _running_engine(smol_path)
    other = eng.add_request(prompts(1, 20, seed=6)[0], greedy(8))
    eng.step()
    sched = eng.scheduler
    seq = eng.seqs[rid]
    sched.running.remove(seq)
    sched.park(seq)  # what an eviction does
    host = eng.kv.host
    assert host is not None
    parked = seq.parked_kv
    assert parked is not None and parked.saved_tokens == parked.num_tokens
    assert host.num_used == len(parked.host_blocks) + (parked.tail_block is not None) > 1
    assert eng.stats()["parked"] == 1
    assert eng.abort(rid)
    assert host.num_used == 0 and eng.stats()["parked"] == 0
    eng.check_invariants()
    run_all(eng)
    assert other not in eng.seqs
    assert_clean(eng)


def test_follow_up_turn_is_served_from_host(smol_path, ref):
    # a conversation's first turn, then enough other traffic to push its blocks off the device
    eng = engine(smol_path, 48 * BS, 0.001)
    turn1 = prompts(1, 100, seed=21)[0]
    rid = eng.add_request(turn1, greedy(8))
    out1 = run_all(eng)[rid]
    for p in prompts(3, 150, seed=22):
        eng.add_request(p, greedy(2))
        run_all(eng)
    assert eng.kv.cached_prefix(turn1) == []  # gone from the device prefix cache
    held = eng.held_block_hashes()  # what the router sees: the history is on host now
    assert set(hash_full_blocks(turn1, BS)) <= set(held["host"])
    assert not set(hash_full_blocks(turn1, BS)) & set(held["device"])
    turn2 = turn1 + out1 + prompts(1, 20, seed=23)[0]
    rid2 = eng.add_request(turn2, greedy(8))
    got = run_all(eng)[rid2]
    assert got == ref.generate(turn2, greedy(8))[0].token_ids
    s = eng.stats()
    assert s["host_prefix_hit_tokens"] >= 100  # the first turn's full blocks, by copy
    assert_clean(eng)


def test_a_float16_cache_parks_restores_and_moves(smol_path):
    """A float16 KV cache (kv_cache_dtype): its host tier holds float16 blocks, evicted
    streams come back by copy with the tokens they would have had never evicted, and a
    snapshot carries float16 KV to another float16 engine (by copy) or to a float32 one."""
    ps = [p[: 9 + 6 * i] for i, p in enumerate(prompts(6, 40, seed=11))]
    ref16 = LLM(smol_path, kv_cache_tokens=4096, block_size=BS, host_cache_gib=0,
                kv_cache_dtype="float16")
    assert ref16.engine.runner.cache.kv.dtype == torch.float16
    want = [o.token_ids for o in ref16.generate(ps, greedy(20))]
    eng = engine(smol_path, 18 * BS, 0.001, admission_lookahead_tokens=0, kv_cache_dtype="float16")
    assert eng.kv.host is not None and eng.kv.host.kv.dtype == torch.float16
    ids = [eng.add_request(p, greedy(20)) for p in ps]
    got = run_all(eng)
    assert [got[i] for i in ids] == want
    s = eng.stats()
    assert s["evictions"] > 0 and s["tokens_restored_copy"] > 0
    assert_clean(eng)

    p = prompts(1, 37, seed=5)[0]
    want = ref16.generate(p, greedy(30))[0].token_ids
    for dst_kv in ("float16", "float32"):
        src = engine(smol_path, 1024, 0.001, kv_cache_dtype="float16")
        rid = src.add_request(p, greedy(30), request_id="moving")
        seen: list[int] = []
        while len(seen) < 11:
            for o in src.step():
                seen.extend(o.delta_token_ids)
        data = src.export_stream(rid)
        record = msgpack.unpackb(data, raw=False)
        assert record["kv"]["dtype"] == "float16" and record["kv"]["tokens"] == 37 + len(seen) - 1
        dst = engine(smol_path, 512, 0.001, kv_cache_dtype=dst_kv)
        assert dst.import_stream(data) == rid
        out = None
        while dst.has_unfinished():
            for o in dst.step():
                out = o
        assert out is not None and out.finish_reason == "length"
        assert dst.stats()["tokens_restored_copy"] == record["kv"]["tokens"]
        if dst_kv == "float16":  # the same KV bits, so the same tokens
            assert out.token_ids == want
        assert_clean(src)
        assert_clean(dst)
