"""CUDA graphs for decode and mixed steps: buckets, padding and static buffers, checked on the
CPU by running the padded "replay" eagerly (the Triton kernel under its interpreter)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU: Triton's interpreter, set before the kernel compiles
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is in the test extra")

from tiny_models import tiny_model_path  # noqa: E402

from kvserve import LLM  # noqa: E402
from kvserve.kvcache.manager import StreamStep  # noqa: E402
from kvserve.workers.model.cuda_graphs import (  # noqa: E402
    GraphKey,
    StepGraphs,
    buckets_for,
    mixed_keys,
    verify_keys,
)
from kvserve.workers.model.step_inputs import build_step  # noqa: E402


def test_buckets() -> None:
    assert buckets_for(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_for(100) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert buckets_for(1) == [1]
    assert buckets_for(10_000)[-1] == 256


def test_mixed_buckets() -> None:
    keys = mixed_keys(2048, 256)
    assert {(k.tokens, k.streams) for k in keys if k.tokens == 32} == {(32, 4), (32, 16), (32, 64)}
    assert max(k.tokens for k in keys) == 2048 and max(k.streams for k in keys) == 256
    assert {k.streams for k in mixed_keys(512, 8)} == {4, 8}
    assert max(k.tokens for k in mixed_keys(100, 8)) == 128
    # any split of T tokens over S streams into 16-token tiles fits the bucket's tiles
    for t, s in [(32, 4), (64, 16), (512, 64), (2048, 256)]:
        key = GraphKey(t, s, 16)
        for lens in ([t - s + 1] + [1] * (s - 1), [t // s] * s, [17] * (t // 17)):
            if len(lens) <= s and sum(lens) <= t:
                assert sum(1 + (q - 1) // 16 for q in lens) <= key.tiles


def _graphs(runner, max_tokens: int = 0) -> StepGraphs:
    scratch = runner.kv.num_blocks - 1
    t = runner.kv.tables
    return StepGraphs(runner.model, runner.cache, runner.attn, max_batch=8,
                      tables=torch.from_numpy(t.array), scratch_block=scratch,
                      max_tokens=max_tokens, extra=2 * t.slots * t.width + 16)


def _changed_blocks(runner, before: torch.Tensor) -> list[int]:
    """The pool's blocks whose K/V differ from `before`."""
    return (runner.cache.kv != before).flatten(2).any(-1).any(0).any(0).nonzero().flatten().tolist()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this with real graphs")
def test_padded_bucket_equals_the_unpadded_step(tmp_path_factory) -> None:
    llm = LLM(tiny_model_path(tmp_path_factory), attention_backend="triton", block_size=4,
              kv_cache_tokens=256)
    runner = llm.engine.runner
    assert runner.graphs is None  # CPU: never captured
    toks = {s: [100 + 13 * i + j for j in range(n)] for i, (s, n) in enumerate([("a", 5), ("b", 9), ("c", 2)])}
    runner.execute([StreamStep(s, t, len(t)) for s, t in toks.items()])
    for t in toks.values():
        t.append(321)
    plan = runner.kv.reserve([StreamStep(s, t, len(t)) for s, t in toks.items()])
    eager = runner._forward(plan)  # the unpadded batch of 3
    scratch = runner.kv.num_blocks - 1
    assert all(scratch not in p.block_ids for p in plan.streams)
    graphs = _graphs(runner)
    step = build_step(plan, 4, runner.max_model_len)
    key = graphs.key_for(step)
    assert key == GraphKey(4, 4, 1)
    before = runner.cache.kv.clone()
    graphs.stage(key, step, [])
    padded = graphs.run(step, key)  # bucket 4: one padding row
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    v = graphs.views(key)
    assert v["slots"][3].item() == scratch * 4
    assert v["tiles"][2].tolist() == [1, 1, 1, 0]
    assert v["tiles"][1].tolist() == [0, 1, 2, 3]
    # tiles name the streams' rows of the persistent block tables
    assert v["tiles"][0].tolist()[:3] == [p.slot for p in plan.streams]
    # the padding row wrote only into the scratch block; the streams' KV is as eager left it
    assert _changed_blocks(runner, before) in ([], [scratch])
    runner.kv.commit(plan)
    # a prefill step never takes a decode graph, and without mixed buckets runs eagerly
    toks["d"] = [7] * 6
    plan = runner.kv.reserve([StreamStep("d", toks["d"], 6)])
    assert graphs.key_for(build_step(plan, 4, runner.max_model_len)) is None
    runner.kv.rollback(plan)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this with real graphs")
def test_padded_mixed_bucket_equals_the_unpadded_step(tmp_path_factory) -> None:
    """A step with prompt chunks (a new stream, a chunk after cached context) beside decode
    tokens, padded to its (tokens, streams) bucket, gives the eager step's logits."""
    llm = LLM(tiny_model_path(tmp_path_factory), attention_backend="triton", block_size=4,
              kv_cache_tokens=256)
    runner = llm.engine.runner
    toks = {s: [200 + 7 * i + j for j in range(n)] for i, (s, n) in enumerate([("a", 6), ("b", 3)])}
    runner.execute([StreamStep(s, t, len(t)) for s, t in toks.items()])
    toks["a"].append(11)  # decode
    toks["b"] += [12, 13, 14, 15, 16]  # a chunk of 5 after 3 cached tokens
    toks["c"] = [300 + j for j in range(21)]  # a new prompt: two 16-token tiles
    steps = [StreamStep(s, t, len(t)) for s, t in toks.items()]
    plan = runner.kv.reserve(steps)
    eager = runner._forward(plan)
    graphs = _graphs(runner, max_tokens=64)
    step = build_step(plan, 4, runner.max_model_len)
    key = graphs.key_for(step)
    assert key == GraphKey(32, 4, 16)  # 27 tokens over 3 streams
    before = runner.cache.kv.clone()
    graphs.stage(key, step, [])
    padded = graphs.run(step, key)
    assert padded.shape == eager.shape == (3, eager.shape[1])
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    v = graphs.views(key)
    assert v["tiles"].shape == (4, min(32, 4 + 2))
    assert v["tiles"][2].tolist() == [1, 5, 16, 5, 0, 0]  # two empty padding tiles
    assert v["slots"][27:].tolist() == [(runner.kv.num_blocks - 1) * 4] * 5
    assert v["last"].tolist() == [0, 5, 26, 0]
    scratch = runner.kv.num_blocks - 1
    assert _changed_blocks(runner, before) in ([], [scratch])
    runner.kv.commit(plan)


def test_verify_buckets() -> None:
    keys = verify_keys(20)
    assert [(k.tokens, k.logits_rows) for k in keys] == [(8, 8), (16, 16), (32, 32)]
    assert verify_keys(10_000)[-1].tokens == 512
    # any verify step of <= T tokens fits: its streams' 16-token tiles and its logits rows
    for key in verify_keys(512):
        assert key.tiles == key.tokens and key.kind == "verify"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this with real graphs")
def test_padded_verify_bucket_equals_the_unpadded_step(tmp_path_factory) -> None:
    """A step verifying proposals (two streams with 3 and 1 proposals beside a plain decode
    stream) runs as its verify bucket: the eager step's logits for every proposed position and
    the one before, padding only in the scratch block."""
    llm = LLM(tiny_model_path(tmp_path_factory), attention_backend="triton", block_size=4,
              kv_cache_tokens=256)
    runner = llm.engine.runner
    toks = {s: [400 + 11 * i + j for j in range(n)] for i, (s, n) in enumerate([("a", 5), ("b", 7), ("c", 3)])}
    runner.execute([StreamStep(s, t, len(t)) for s, t in toks.items()])
    for t in toks.values():
        t.append(9)
    drafts = {"a": [21, 22, 23], "b": [31], "c": []}
    steps = [StreamStep(s, t, len(t) + len(drafts[s]), draft=drafts[s]) for s, t in toks.items()]
    plan = runner.kv.reserve(steps)
    eager = runner._forward(plan)
    graphs = _graphs(runner, max_tokens=64)
    assert graphs.verify == []  # none without a verify budget
    graphs = StepGraphs(graphs.model, graphs.cache, graphs.attn, max_batch=8, tables=graphs.tables,
                        scratch_block=runner.kv.num_blocks - 1, max_tokens=64,
                        extra=graphs.inputs.numel() - graphs.static, verify_tokens=8 * 5)
    step = build_step(plan, 4, runner.max_model_len)
    assert step.sample_rows is not None and len(step.sample_rows) == 4 + 2 + 1
    key = graphs.key_for(step)
    assert key == GraphKey(8, 8, 16, rows=8)  # 7 tokens, 7 logits rows
    before = runner.cache.kv.clone()
    graphs.stage(key, step, [])
    padded = graphs.run(step, key)
    assert padded.shape == eager.shape == (7, eager.shape[1])
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    v = graphs.views(key)
    assert v["last"].tolist() == [*step.sample_rows.tolist(), 0]
    scratch = runner.kv.num_blocks - 1
    assert v["slots"][7:].tolist() == [scratch * 4]
    assert _changed_blocks(runner, before) in ([], [scratch])
    runner.kv.rollback(plan)
