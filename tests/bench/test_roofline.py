"""The decode roofline's arithmetic and the batched table's roofline columns (CUDA prints
them; here the rows are given)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model_path

from kvserve.bench.batched import format_table
from kvserve.bench.roofline import (
    copy_bandwidth_gbps,
    decode_roofline,
    kv_bytes_per_token,
    weight_bytes,
)
from kvserve.config import EngineConfig
from kvserve.workers.loading.loader import load_model
from kvserve.workers.model.runner import ModelRunner


def test_roofline_arithmetic() -> None:
    # 1 GB of weights, no KV, 1000 GB/s: 1000 steps/s of B tokens each
    assert decode_roofline(10**9, 0, 8, 100, 1000.0) == pytest.approx(8000.0)
    # KV adds B * context * bytes per token to each step
    assert decode_roofline(10**9, 10**4, 10, 10**4, 1000.0) == pytest.approx(10 * 1000 / 2)
    assert kv_bytes_per_token(16, 8, 64, torch.bfloat16) == 16 * 2 * 8 * 64 * 2
    with pytest.raises(ValueError, match="CUDA"):
        copy_bandwidth_gbps(torch.device("cpu"))


def test_weight_bytes_count_every_layer_and_the_head(tmp_path_factory) -> None:
    runner = ModelRunner(load_model(tiny_model_path(tmp_path_factory)),
                         EngineConfig(kv_cache_tokens=64, block_size=4, host_cache_gib=0))
    c = runner.model_config
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * c.intermediate_size * h + 2 * h
    assert weight_bytes(runner.model) == 4 * (c.num_layers * per_layer + h + c.vocab_size * h)


def test_weight_bytes_count_shared_storage_once() -> None:
    """Stacked experts and the per-expert views of them (an MoE block's layout), reached in
    either order, and a head tied to a layer's tensor, count once; a neighbouring slice of
    one buffer counts as its own bytes."""
    from types import SimpleNamespace

    from kvserve.workers.model.quant_linear import Linear

    w13, w2 = torch.zeros(4, 6, 8), torch.zeros(4, 8, 3)
    experts = [SimpleNamespace(gate_up=Linear(w13[e]), down=Linear(w2[e])) for e in range(4)]
    buf = torch.zeros(10)
    for order in (["w13", "w2", "experts"], ["experts", "w13", "w2"]):
        moe = {"experts": experts, "w13": w13, "w2": w2}
        layer = SimpleNamespace(mlp=SimpleNamespace(**{k: moe[k] for k in order}), n=buf[:4])
        model = SimpleNamespace(norm=buf[4:], lm_head=Linear(w2[1]), layers=[layer])
        assert weight_bytes(model) == 4 * (w13.numel() + w2.numel() + buf.numel())


def test_batched_table_has_roofline_columns_when_given() -> None:
    row = {"PP": 128, "TG": 32, "B": 8, "N_KV": 1280, "T_PP": 0.1, "S_PP": 10240.0, "T_TG": 0.2,
           "S_TG": 1280.0, "T": 0.3, "S": 4266.0}
    assert "ROOF" not in format_table([row])
    text = format_table([dict(row, ROOF_TG=2560.0, FRAC_TG=0.5, copy_GBps=3000.0)])
    assert "ROOF t/s" in text and "50.0%" in text and "3000 GB/s" in text
