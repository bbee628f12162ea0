"""A step that raises midway leaves the KV cache consistent and the stream usable."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.kvcache.manager import KVCacheFull, StreamStep
from kvserve.workers.loading.loader import load_model
from kvserve.workers.model.runner import ModelRunner


class FailingAttention:
    """Wraps the real backend and raises once, at a chosen layer of a chosen call."""

    def __init__(self, inner, fail_layer: int) -> None:
        self.inner = inner
        self.name = "failing"
        self.fail_layer = fail_layer
        self.armed = False

    def prepare(self, meta, device):
        self.inner.prepare(meta, device)

    def forward(self, layer, q, k, v, cache, meta):
        if self.armed and layer == self.fail_layer:
            self.armed = False
            raise RuntimeError("injected failure")
        return self.inner.forward(layer, q, k, v, cache, meta)


@pytest.fixture(scope="module")
def loaded(smol_path):
    return load_model(smol_path)


def test_failed_step_rolls_back_and_stream_continues(loaded):
    cfg = EngineConfig(kv_cache_tokens=256, block_size=16, enable_prefix_caching=True)
    ref = ModelRunner(loaded, cfg)
    runner = ModelRunner(loaded, cfg)
    runner.attn = FailingAttention(runner.attn, fail_layer=15)
    # op by op (the one-call C step gives the same bits) so the failure strikes mid-step
    runner.model.cpu_step = None
    a = list(range(200, 230))
    b = list(range(300, 311))
    for r in (ref, runner):
        r.execute([StreamStep("a", a, len(a))])
    before = (list(runner.kv.pool.ref_cnt), runner.kv.num_computed("a"), list(runner.kv.block_table("a")))
    a2 = a + [5, 6, 7]
    runner.attn.armed = True
    with pytest.raises(RuntimeError, match="injected"):
        # a grows into a new block and b is admitted: both must be undone
        runner.execute([StreamStep("a", a2, len(a2)), StreamStep("b", b, len(b))])
    runner.kv.check_invariants()
    assert (list(runner.kv.pool.ref_cnt), runner.kv.num_computed("a"), list(runner.kv.block_table("a"))) == before
    assert not runner.kv.has_stream("b")
    # half the layers wrote K/V for a's new tokens before the failure; recomputing
    # the same step must give exactly the logits of a runner that never failed
    _, got = runner.execute([StreamStep("a", a2, len(a2)), StreamStep("b", b, len(b))])
    _, want = ref.execute([StreamStep("a", a2, len(a2)), StreamStep("b", b, len(b))])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_step_that_does_not_fit_changes_nothing(loaded):
    runner = ModelRunner(loaded, EngineConfig(kv_cache_tokens=64, block_size=16))
    runner.execute([StreamStep("a", list(range(100, 140)), 40)])  # 3 of 4 blocks
    before = (list(runner.kv.pool.ref_cnt), list(runner.kv.pool.free_queue))
    with pytest.raises(KVCacheFull):
        runner.execute([StreamStep("b", list(range(500, 540)), 40)])
    assert (list(runner.kv.pool.ref_cnt), list(runner.kv.pool.free_queue)) == before
    assert not runner.kv.has_stream("b")
