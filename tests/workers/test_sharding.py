"""Which part of each weight a tensor-parallel rank holds, as the loaders read it: the ranks'
parts put together are the whole model's weights (safetensors, sharded HF MoE experts, GGUF
quantized rows), a split of the input dimension off the ggml block boundaries keeps no raw
rows (fp32 path), whole KV heads survive a gather and a split, and the sizes a model cannot
take are refused with the numbers."""

from __future__ import annotations

import gguf
import pytest
import torch
from moe_models import make_moe_model
from tiny_models import make_tiny_hf_model, write_gguf

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.loader import load_model
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.loading.sharding import (
    Shard,
    ShardLayout,
    check_tensor_parallel,
    kv_head_ranks,
)
from kvserve.workers.model.parallel.kv_heads import merge_heads, split_heads


def cfg(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=1001, hidden_size=64, intermediate_size=96,
                num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8)
    return ModelConfig(**{**base, **kw})


def whole(parts: list, name: str, layout: ShardLayout) -> torch.Tensor:
    split = layout.split(name)
    if name.endswith(("k_proj.weight", "v_proj.weight")):  # a replicated KV head counts once
        parts = [parts[r] for r in sorted(set(kv_head_ranks(layout.cfg.num_kv_heads, layout.size)))]
    return torch.cat([p.weights[name] for p in parts], dim=split.dim)


def test_layout_of_heads_mlp_and_vocabulary():
    c = cfg()
    a, b = (ShardLayout(c, Shard(r, 4)) for r in (1, 3))
    assert (a.num_heads, a.num_kv_heads, a.kv_heads) == (2, 1, (0, 1))  # KV head 0 on ranks 0, 1
    assert (b.num_heads, b.kv_heads) == (2, (1, 2))
    assert a.split("model.layers.0.self_attn.q_proj.weight").ranges == ((16, 32),)
    assert a.split("model.layers.0.self_attn.k_proj.weight").ranges == ((0, 8),)
    assert a.split("model.layers.0.self_attn.o_proj.weight").dim == 1
    assert a.split("model.layers.0.mlp.down_proj.weight").ranges == ((24, 48),)
    assert a.row_parallel("model.layers.0.mlp.down_proj.weight")
    assert not a.row_parallel("model.layers.0.mlp.gate_proj.weight")
    assert a.split("model.layers.0.input_layernorm.weight") is None
    # 1001 rows: 251 per rank, the last rank's 248 padded by the model
    assert (a.vocab, b.vocab, a.vocab_per_rank) == ((251, 502), (753, 1001), 251)
    phi = ShardLayout(cfg(architecture="phi3"), Shard(1, 2))
    assert phi.split("model.layers.0.self_attn.qkv_proj.weight").ranges == (
        (32, 64), (64 + 8, 64 + 16), (80 + 8, 80 + 16))
    assert phi.split("model.layers.0.mlp.gate_up_proj.weight").ranges == ((48, 96), (144, 192))
    moe = ShardLayout(cfg(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), Shard(1, 2))
    assert moe.split("model.layers.0.mlp.experts.gate_proj.weight").ranges == ((16, 32),)
    assert moe.split("model.layers.0.mlp.experts.down_proj.weight").dim == 2
    assert not moe.row_parallel("model.layers.0.mlp.experts.down_proj.weight")
    assert moe.split("model.layers.0.mlp.gate.weight") is None  # the router is whole


@pytest.mark.parametrize("size,message", [
    (3, "does not divide the model's 8 attention heads"),
    (16, "does not divide the model's 8 attention heads"),
])
def test_sizes_a_model_cannot_take(size, message):
    with pytest.raises(ModelLoadError, match=message):
        check_tensor_parallel(cfg(), size, "m")


def test_kv_head_and_mlp_rules():
    check_tensor_parallel(cfg(num_kv_heads=1), 8, "m")  # replicated on every rank
    with pytest.raises(ModelLoadError, match="must divide the model's 6 KV heads, or be a multiple"):
        check_tensor_parallel(cfg(num_heads=12, num_kv_heads=6), 4, "m")
    with pytest.raises(ModelLoadError, match="intermediate size 90"):
        check_tensor_parallel(cfg(intermediate_size=90), 4, "m")
    with pytest.raises(ModelLoadError, match="experts' intermediate size 30"):
        check_tensor_parallel(cfg(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=30), 4, "m")


@pytest.mark.parametrize("heads,size", [(4, 2), (2, 2), (1, 2), (2, 4)])
def test_whole_heads_survive_a_gather_and_a_split(heads, size):
    blocks = torch.randn(2, 2, 3, 4, heads, 8)
    parts = [split_heads(blocks, r, size) for r in range(size)]
    assert all(p.shape[4] == max(1, heads // size) for p in parts)
    assert torch.equal(merge_heads(parts, heads), blocks)
    assert kv_head_ranks(heads, size) == [h * size // heads if heads < size else h // (heads // size)
                                          for h in range(heads)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("shard_tiny"), "llama", seed=2,
                              with_tokenizer=False)


def test_safetensors_parts_make_the_whole(tiny):
    full = load_model(tiny)
    parts = [load_model(tiny, shard=Shard(r, 2)) for r in range(2)]
    layout = ShardLayout(full.config, Shard(0, 2))
    for name, w in full.weights.items():
        if layout.split(name) is None:
            assert all(torch.equal(p.weights[name], w) for p in parts), name
        else:
            assert torch.equal(whole(parts, name, layout), w), name


@pytest.mark.parametrize("size", [2, 4])
def test_gguf_quantized_parts(tiny, tmp_path, size):
    """Q8_0 rows split freely; o_proj's input columns split in 32 (size 2) on block
    boundaries and keep their raw rows, in 16 (size 4) off them and run in fp32."""
    path = write_gguf(tmp_path / "q8.gguf", tiny, gguf.GGMLQuantizationType.Q8_0)
    full = load_model(path)
    parts = [load_model(path, shard=Shard(r, size)) for r in range(size)]
    layout = ShardLayout(full.config, Shard(0, size))
    for name, w in full.weights.items():
        if layout.split(name) is not None:
            assert torch.equal(whole(parts, name, layout), w), name
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([p.quantized[q].data for p in parts]), full.quantized[q].data)
    if size == 2:
        assert torch.equal(torch.cat([p.quantized[o].data for p in parts], dim=1),
                           full.quantized[o].data)
    else:
        assert all(o not in p.quantized for p in parts)


def test_hf_experts_one_tensor_each_are_split_before_stacking(tmp_path):
    path = make_moe_model(tmp_path / "moe", "qwen3_moe", seed=1)
    full = load_model(path)
    parts = [load_model(path, shard=Shard(r, 2)) for r in range(2)]
    layout = ShardLayout(full.config, Shard(0, 2))
    for name in ("model.layers.1.mlp.experts.gate_proj.weight",
                 "model.layers.1.mlp.experts.down_proj.weight"):
        assert parts[0].weights[name].shape[layout.split(name).dim] == 16
        assert torch.equal(whole(parts, name, layout), full.weights[name]), name
