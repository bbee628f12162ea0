"""Decode CUDA graphs: buckets, padding and static buffers, checked on the CPU by running the
padded "replay" eagerly (the Triton kernel under its interpreter)."""

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
from kvserve.workers.model.cuda_graphs import DecodeGraphs, buckets_for  # noqa: E402
from kvserve.workers.model.step_inputs import build_step  # noqa: E402


def test_buckets() -> None:
    assert buckets_for(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_for(100) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert buckets_for(1) == [1]
    assert buckets_for(10_000)[-1] == 256


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
    graphs = DecodeGraphs(runner.model, runner.cache, runner.attn, max_batch=8, max_blocks=16,
                          scratch_block=scratch)
    step = build_step(plan, 4, runner.max_model_len)
    assert graphs.fits(step)
    before = runner.cache.kv.clone()
    padded = graphs.run(step)  # bucket 4: one padding row
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    v = graphs.views(4)
    assert v["slots"][3].item() == scratch * 4
    assert v["tiles"][2].tolist() == [1, 1, 1, 0]
    assert v["tiles"][0].tolist() == v["tiles"][1].tolist() == [0, 1, 2, 3]
    # the padding row wrote only into the scratch block; the streams' KV is as eager left it
    changed = (runner.cache.kv != before).flatten(2).any(-1).any(0).any(0).nonzero().flatten()
    assert changed.tolist() in ([], [scratch])
    runner.kv.commit(plan)
    # a prefill step never takes the graph path
    toks["d"] = [7] * 6
    plan = runner.kv.reserve([StreamStep("d", toks["d"], 6)])
    assert not graphs.fits(build_step(plan, 4, runner.max_model_len))
    runner.kv.rollback(plan)
