"""Tensor-parallel engines on the CPU: real rank processes in a gloo group, real models.

Greedy float32 tokens equal the single-device engine's: the default model (SmolLM2-135M GGUF
Q4_1, 9 heads / 3 KV heads) at size 3; tiny models at size 2 with one KV head (replicated on
both ranks, an odd vocabulary padded for the gather; prefix caching, evictions through the
host tier), Phi-3's fused q/k/v and gate/up, and Qwen3-MoE from a Q8_0 GGUF (experts split
by rows and by columns off the ggml block boundaries). A stream snapshotted on a size-2
engine resumes on a size-1 engine, and the other way, with the undisturbed tokens. A killed
rank fails the engine with an error naming it instead of hanging in a collective; closing an
engine, or failing to start one, leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
from arch_models import make_arch_model
from moe_models import make_moe_model, write_moe_gguf
from tiny_models import make_tiny_hf_model

from kvserve import LLM, SamplingParams
from kvserve.errors import EngineDeadError, ModelLoadError
from kvserve.workers.engine.engine import LLMEngine

BS = 4
NEW = 8


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def prompts() -> list[list[int]]:
    """6 prompts of 5 to 33 tokens; three share a 16-token prefix (four full blocks)."""
    rng = random.Random(3)
    shared = [rng.randrange(100, 40000) for _ in range(16)]
    out = []
    for i, n in enumerate([5, 33, 17, 30, 9, 25]):
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        out.append(shared + ids[: n - 16] if i % 2 else ids)
    return out


def small_pool(path: str, **kw) -> LLM:
    # 20 blocks for 6 streams of up to 41 tokens: streams are parked to host and come back
    return LLM(path, kv_cache_tokens=20 * BS, block_size=BS, host_cache_gib=0.001,
               max_num_batched_tokens=32, admission_lookahead_tokens=0, dtype="float32", **kw)


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@contextlib.contextmanager
def parallel(make) -> Iterator[LLM]:
    """A tensor-parallel LLM, closed after the block; its rank processes must be gone then
    (rank 0's torch threads, shared with this process, are put back too)."""
    threads = torch.get_num_threads()
    llm = make()
    pids = llm.engine.shard_pids()
    assert pids and set(pids) <= children()
    try:
        yield llm
    finally:
        llm.close()
        torch.set_num_threads(threads)
        assert not set(pids) & children(), "a rank process outlived its engine"


@pytest.fixture(scope="module")
def one_kv(tmp_path_factory) -> str:
    """A tiny Llama with one KV head for four query heads and a vocabulary of 49155 (not a
    multiple of 2: the last rank's LM-head rows are padded)."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("one_kv"), "llama", seed=3,
                              num_key_value_heads=1, vocab_size=49155)


def run(eng: LLMEngine, ps: list[list[int]], n: int = NEW) -> list[list[int]]:
    ids = [eng.add_request(p, greedy(n)) for p in ps]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        eng.check_invariants()
    return [done[i] for i in ids]


def test_default_model_at_size_3(smol_path, smol_llm):
    ps = ["The capital of France is", "1, 2, 3, 4,"]
    want = [o.token_ids for o in smol_llm.generate(ps, greedy())]
    with parallel(lambda: LLM(smol_path, tensor_parallel_size=3, kv_cache_tokens=1024,
                              num_threads=2)) as llm:
        got = [o.token_ids for o in llm.generate(ps, greedy())]
        stats = llm.engine.stats()
        runner = llm.engine.runner
        # the GGUF's Q4_1 rows split on block boundaries at size 3: the ranks keep the
        # quantized kernel for o_proj and down_proj too
        assert runner.model.layers[0].attn.o.inner.quant is not None
        assert runner.model.layers[0].mlp.down.inner.quant is not None
        assert runner.cache.num_kv_heads == 1
    assert got == want
    assert stats["tensor_parallel_size"] == 3 and stats["tp_collectives"] > 0


@pytest.fixture(scope="module")
def tp2(one_kv) -> Iterator[LLM]:
    with parallel(lambda: small_pool(one_kv, tensor_parallel_size=2)) as llm:
        yield llm


def test_one_kv_head_replicated_with_prefix_cache_and_host_tier(one_kv, tp2):
    ps = prompts()
    first, rest = ps[1], ps[:1] + ps[2:]
    ref = small_pool(one_kv).engine
    want = run(ref, [first]) + run(ref, rest)
    eng = tp2.engine
    before = eng.stats()
    # the first turn alone, so that its shared prefix is cached when the others arrive
    got = run(eng, [first]) + run(eng, rest)
    stats = eng.stats()
    assert got == want
    assert eng.runner.cache.num_kv_heads == 1  # each rank holds the one KV head
    assert stats["evictions"] > before["evictions"], stats
    assert stats["tokens_restored_copy"] > before["tokens_restored_copy"], stats
    assert stats["prefix_cache_hit_rate"] > 0, stats
    assert stats["kv_blocks_used"] == 0 and stats["host_blocks_used"] == 0


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, str]:
    import gguf

    root = tmp_path_factory.mktemp("tp_families")
    moe = make_moe_model(root / "moe", "qwen3_moe", seed=13)
    return {
        "phi3": make_arch_model(root / "phi3", "phi3", seed=5),
        "qwen3_moe_q8": write_moe_gguf(root / "moe.gguf", moe, "qwen3_moe",
                                       gguf.GGMLQuantizationType.Q8_0),
    }


@pytest.mark.parametrize("family", ["phi3", "qwen3_moe_q8"])
def test_families_at_size_2(families, family):
    path = families[family]
    ps = prompts()[:3]
    want = [o.token_ids for o in small_pool(path).generate(ps, greedy())]
    with parallel(lambda: small_pool(path, tensor_parallel_size=2)) as llm:
        got = [o.token_ids for o in llm.generate(ps, greedy())]
    assert got == want


def _until(eng: LLMEngine, rid: str, n: int) -> list[int]:
    seen: list[int] = []
    while len(seen) < n:
        for o in eng.step():
            if o.request_id == rid:
                seen.extend(o.delta_token_ids)
    return seen


def _finish(eng: LLMEngine, rid: str) -> list[int]:
    out: list[int] = []
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                out.extend(o.delta_token_ids)
    return out


@pytest.mark.parametrize("direction", ["2 to 1", "1 to 2"])
def test_snapshot_moves_between_sizes(one_kv, tp2, direction):
    """The snapshot carries whole KV heads: the stream continues on an engine of the other
    size from the KV it brought (copied in, not recomputed) with the undisturbed tokens."""
    rng = random.Random(direction)  # a prompt no other test cached
    p = [rng.randrange(100, 40000) for _ in range(30)]
    want = LLM(one_kv, kv_cache_tokens=1024, block_size=BS).generate(p, greedy(30))[0].token_ids
    single = small_pool(one_kv, enable_prefix_caching=False)
    src, dst = (tp2.engine, single.engine) if direction == "2 to 1" else (single.engine, tp2.engine)
    rid = src.add_request(p, greedy(30), request_id=f"moving {direction}")
    seen = _until(src, rid, 11)
    data = src.export_stream(rid)
    before = dst.stats()
    assert dst.import_stream(data) == rid
    seen += _finish(dst, rid)
    stats = dst.stats()
    assert seen == want
    assert stats["tokens_restored_copy"] - before["tokens_restored_copy"] == 30 + 11 - 1
    assert stats["tokens_recomputed"] == before["tokens_recomputed"]


def test_a_killed_rank_fails_the_engine_at_once(one_kv):
    threads = torch.get_num_threads()
    llm = LLM(one_kv, kv_cache_tokens=256, block_size=BS, tensor_parallel_size=2)
    try:
        eng = llm.engine
        rid = eng.add_request(prompts()[1], greedy(50))
        _until(eng, rid, 2)
        (pid,) = eng.shard_pids()
        os.kill(pid, signal.SIGKILL)
        eng.runner.ranks.procs[0].wait(timeout=60)  # gone before the next step
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {pid}\) died \(killed by SIGKILL\)"):
            eng.step()
        with pytest.raises(EngineDeadError, match="rank 1"):  # and stays failed
            eng.step()
        assert time.monotonic() - t0 < 60  # the collective failed, it did not wait it out
    finally:
        llm.close()
        torch.set_num_threads(threads)
    assert pid not in children()


def test_sizes_the_model_cannot_split_are_refused(one_kv, smol_path):
    """Before any rank starts: the model's configuration says no."""
    before = children()
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 3 does not divide the "
                                             "model's 4 attention heads"):
        LLM(one_kv, tensor_parallel_size=3, kv_cache_tokens=256)
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 2 does not divide the "
                                             "model's 9 attention heads"):
        LLM(smol_path, tensor_parallel_size=2, kv_cache_tokens=256)
    assert children() <= before  # the ranks that had started are gone
    with pytest.raises(ValueError, match="async_scheduling is not available"):
        LLM(one_kv, tensor_parallel_size=2, async_scheduling=True)


@pytest.mark.parametrize("direction", ["2 to 1", "1 to 2"])
def test_live_moves_between_sizes(one_kv, tp2, direction):
    """A running stream moves live between engines of different sizes (the rounds carry
    whole KV heads; the tensor-parallel side stages them through its host tier's ranks),
    decoding between rounds, and goes on with the undisturbed tokens from the KV it brought."""
    from kvserve.workers.engine.live_move import Source, Target

    rng = random.Random(f"live {direction}")
    p = [rng.randrange(100, 40000) for _ in range(30)]
    want = LLM(one_kv, kv_cache_tokens=1024, block_size=BS).generate(p, greedy(30))[0].token_ids
    single = small_pool(one_kv)
    src, dst = (tp2.engine, single.engine) if direction == "2 to 1" else (single.engine, tp2.engine)
    rid = src.add_request(p, greedy(30), request_id=f"live {direction}")
    seen = _until(src, rid, 6)
    source, info = Source.begin(src, rid, "dst")
    target = Target.reserve(dst, info, growth_tokens=16)
    while True:
        meta, data = source.round(src, 2)
        target.write(dst, meta, data)
        if meta["left"] == 0 and meta["tokens"] >= 30 + 10:
            break
        for o in src.step():  # it decodes between rounds
            if o.request_id == rid:
                seen.extend(o.delta_token_ids)
    meta, data = source.freeze(src)
    assert meta["blocks"] <= 2
    target.commit(dst, meta, data)
    source.release(src)
    recomputed = dst.stats()["tokens_recomputed"]
    seen += _finish(dst, rid)
    assert seen == want
    assert dst.stats()["tokens_recomputed"] == recomputed  # it computed only new tokens
    for eng in (src, dst):
        eng.check_invariants()
        assert not eng.kv.reserved and not eng.kv.held and eng.kv.streams == {}
