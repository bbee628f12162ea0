"""The vectorized step inputs equal the per-token construction they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.kvcache.manager import PlannedStream, StepPlan
from kvserve.workers.model.step_inputs import build_step, to_device


def _plan() -> StepPlan:
    rng = np.random.default_rng(0)
    streams, tokens = [], {}
    for i, (start, target) in enumerate([(0, 9), (12, 13), (5, 22), (30, 31), (0, 1)]):
        blocks = rng.permutation(100)[: -(-target // 4)].tolist()
        sid = f"s{i}"
        tokens[sid] = rng.integers(0, 1000, target + 3).tolist()
        streams.append(PlannedStream(sid, start, target, blocks, [], [], start == 0))
    return StepPlan(streams, tokens)


def test_matches_per_token_loops() -> None:
    plan, bs = _plan(), 4
    s = build_step(plan, bs, max_model_len=64)
    ids, pos, slots, last = [], [], [], []
    for p in plan.streams:
        for i in range(p.start, p.target):
            ids.append(plan.token_ids[p.stream_id][i])
            pos.append(i)
            slots.append(p.block_ids[i // bs] * bs + i % bs)
        last.append(len(ids) - 1)
    assert s.input_ids.tolist() == ids
    assert s.positions.tolist() == pos
    assert s.slot_mapping.tolist() == slots
    assert s.logits_indices.tolist() == last
    assert s.query_lens.tolist() == [9, 1, 17, 1, 1]
    assert s.context_lens.tolist() == [0, 12, 5, 30, 0]
    for row, p in zip(s.block_tables, plan.streams, strict=True):
        assert row[: len(p.block_ids)].tolist() == p.block_ids


def test_rejects_streams_past_max_model_len() -> None:
    with pytest.raises(ValueError, match="s2: 22 tokens exceed max_model_len 20"):
        build_step(_plan(), 4, max_model_len=20)


def test_to_device_keeps_shapes_and_values() -> None:
    a, b = np.arange(5), np.arange(6).reshape(2, 3)
    ta, tb = to_device([a, b], torch.device("cpu"))
    assert ta.dtype == torch.int64 and ta.tolist() == a.tolist() and tb.tolist() == b.tolist()
