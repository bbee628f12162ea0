"""Weight loaders: GGUF and HF directories against transformers' own view of the same files."""

from __future__ import annotations

import json
import os

import gguf
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import (
    TINY_VOCAB_SIZE,
    make_tiny_hf_model,
    tiny_hf_config,
    write_gguf,
)

from kvserve.errors import ModelLoadError
from kvserve.models import default_model
from kvserve.workers.loading.loader import LoadedModel, expected_weight_shapes, load_model

Q = gguf.GGMLQuantizationType


def hf_state_dict(
    path: str, gguf_file: str | None = None
) -> tuple[dict[str, torch.Tensor], object]:
    """Weights and config as transformers loads them."""
    from transformers import AutoModelForCausalLM

    if gguf_file is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file)
    return model.state_dict(), model.config


def assert_same_weights(
    loaded: LoadedModel, reference: dict[str, torch.Tensor], atol: float = 0.0
) -> None:
    """Every tensor the loader returns equals transformers' (lm_head tied when absent)."""
    weights = loaded.weights
    assert set(weights) == set(expected_weight_shapes(loaded.config))
    expected_names = set(reference)
    if loaded.config.tie_word_embeddings:
        assert "lm_head.weight" not in weights
        expected_names.discard("lm_head.weight")
        if "lm_head.weight" in reference:  # transformers ties it to the embedding
            assert torch.equal(weights["model.embed_tokens.weight"], reference["lm_head.weight"])
    assert set(weights) == expected_names
    for name, ref in reference.items():
        if name not in weights:
            continue
        got = weights[name]
        assert got.shape == ref.shape, name
        assert got.dtype == torch.float32, name
        if atol == 0:
            assert torch.equal(got, ref), name
        else:
            # tolerance relative to the tensor's range: quantization error scales with it
            limit = atol * float(ref.abs().max())
            error = float((got - ref).abs().max())
            assert error <= limit, f"{name}: max error {error} > {limit}"


def assert_config_matches(loaded: LoadedModel, hf_config: object) -> None:
    cfg = loaded.config
    assert cfg.vocab_size == hf_config.vocab_size
    assert cfg.hidden_size == hf_config.hidden_size
    assert cfg.intermediate_size == hf_config.intermediate_size
    assert cfg.num_layers == hf_config.num_hidden_layers
    assert cfg.num_heads == hf_config.num_attention_heads
    assert cfg.num_kv_heads == hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None)  # Qwen2Config has none
    assert cfg.head_dim == (head_dim or hf_config.hidden_size // hf_config.num_attention_heads)
    assert cfg.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert cfg.rope_theta == pytest.approx(hf_config.rope_parameters["rope_theta"])
    assert cfg.max_position_embeddings == hf_config.max_position_embeddings
    assert cfg.tie_word_embeddings == hf_config.tie_word_embeddings
    assert cfg.bos_token_id == hf_config.bos_token_id
    assert hf_config.eos_token_id in cfg.eos_token_ids


# ---------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def smollm2(hf_smol) -> tuple[LoadedModel, dict[str, torch.Tensor], object]:
    # transformers' own load of the GGUF, shared with the greedy oracle (conftest.hf_smol)
    loaded = load_model(default_model())
    return loaded, hf_smol.state_dict(), hf_smol.config


def test_smollm2_gguf_matches_transformers(smollm2) -> None:
    loaded, reference, hf_config = smollm2
    assert loaded.path == default_model()
    assert loaded.config.architecture == "llama"
    assert loaded.config.tie_word_embeddings  # the file has no output.weight
    assert loaded.config.rope_scaling is None
    assert_config_matches(loaded, hf_config)
    # Both sides dequantize with the same gguf package: exact equality, and the
    # un-permuted Q/K rows must match transformers' reverse permutation.
    assert_same_weights(loaded, reference)


# ---------------------------------------------------------------- HF directories


@pytest.mark.parametrize(
    ("arch", "tied", "shard"),
    [
        ("llama", False, None),
        ("llama", True, "1MB"),
        ("mistral", False, "1MB"),
        ("qwen2", False, None),
        ("qwen2", True, "1MB"),
    ],
)
def test_hf_dir_roundtrip(tmp_path, arch: str, tied: bool, shard: str | None) -> None:
    path = make_tiny_hf_model(
        tmp_path / arch, arch, tie_word_embeddings=tied, max_shard_size=shard, with_tokenizer=False
    )
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json")) == bool(shard)
    loaded = load_model(path)
    reference, hf_config = hf_state_dict(path)
    assert loaded.config.architecture == arch
    assert loaded.config.attention_bias == (arch == "qwen2")
    assert loaded.config.rope_scaling is None
    assert_config_matches(loaded, hf_config)
    assert_same_weights(loaded, reference)


def test_hf_dir_llama3_rope_and_dtype(tmp_path) -> None:
    path = make_tiny_hf_model(tmp_path / "l3", rope_scaling="llama3", with_tokenizer=False)
    loaded = load_model(str(path), dtype=torch.bfloat16)
    assert loaded.config.rope_theta == 500000.0
    assert loaded.config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert loaded.config.max_position_embeddings == 65536
    stored = load_file(os.path.join(path, "model.safetensors"))
    for name, tensor in loaded.weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, stored[name].to(torch.bfloat16)), name


def test_hf_dir_old_style_config_and_bin_weights(tmp_path) -> None:
    """transformers-4 config keys (rope_theta/rope_scaling) and pytorch_model.bin."""
    path = make_tiny_hf_model(tmp_path / "m", "mistral", with_tokenizer=False)
    weights = load_file(os.path.join(path, "model.safetensors"))
    torch.save(weights, os.path.join(path, "pytorch_model.bin"))
    os.remove(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    del config["rope_parameters"]
    config.update(
        rope_theta=1e6,
        rope_scaling={"type": "linear", "factor": 2.0},
        eos_token_id=[2, 7],
        max_position_embeddings=32768,
        sliding_window=4096,
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [7, 9]}, f)

    loaded = load_model(path)
    assert loaded.config.rope_theta == 1e6
    assert loaded.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert loaded.config.eos_token_ids == [2, 7, 9]
    # Mistral's window applies to every layer; the context stays the model's
    assert loaded.config.max_position_embeddings == 32768
    assert loaded.config.sliding_window == 4096 and loaded.config.all_sliding
    for name, tensor in weights.items():
        assert torch.equal(loaded.weights[name], tensor), name


def test_make_tiny_hf_model_writes_real_tokenizer(tmp_path) -> None:
    from transformers import AutoTokenizer

    path = make_tiny_hf_model(tmp_path / "tok", "qwen2", seed=3)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == TINY_VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert load_model(path).config.vocab_size == TINY_VOCAB_SIZE


# ---------------------------------------------------------------- GGUF written from HF models


@pytest.mark.parametrize(
    ("arch", "qtype", "atol"),
    [
        ("llama", Q.F32, 0.0),
        ("llama", Q.F16, 1e-3),
        ("llama", Q.Q8_0, 1e-2),
        ("llama", Q.Q4_0, 0.15),  # 4-bit blocks: error up to 1/8 of the block's range
        ("mistral", Q.BF16, 1e-2),
        ("qwen2", Q.F32, 0.0),
        ("qwen2", Q.Q8_0, 1e-2),
    ],
    ids=lambda value: value.name if isinstance(value, Q) else None,
)
def test_gguf_from_hf_model(tmp_path, arch: str, qtype: Q, atol: float) -> None:
    hf_dir = make_tiny_hf_model(tmp_path / arch, arch, seed=1, with_tokenizer=False)
    # llama.cpp labels Mistral models "llama"; also accept a file that says "mistral"
    gguf_arch = "mistral" if arch == "mistral" else None
    path = write_gguf(tmp_path / "m.gguf", hf_dir, qtype, arch=gguf_arch)
    loaded = load_model(path)
    reference, hf_config = hf_state_dict(hf_dir)
    assert loaded.config.architecture == arch
    assert_config_matches(loaded, hf_config)
    assert_same_weights(loaded, reference, atol=atol)


def test_q3_k_blocks_become_q6_k_blocks_of_the_same_values() -> None:
    """Every Q3_K block (random bytes: every scale, low-bit and high-bit pattern) rewritten as
    Q6_K dequantizes to gguf's float32 bits for the original, with leading dimensions kept
    (MoE experts' rows)."""
    import numpy as np
    from gguf.quants import dequantize

    from kvserve.workers.loading.quant_format import as_q6_k

    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(2, 5, 3 * 110), dtype=np.uint8)
    d = rng.uniform(-0.1, 0.1, size=(2, 5, 3)).astype(np.float16)
    for k in range(3):
        raw[..., 110 * k + 108:110 * k + 110] = d[..., k:k + 1].view(np.uint8)
    out = as_q6_k(raw)
    assert out.shape == (2, 5, 3 * 210)
    want = dequantize(raw.reshape(10, -1), Q.Q3_K)
    got = dequantize(out.reshape(10, -1), Q.Q6_K)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_layout_agrees_with_transformers(tmp_path, arch: str) -> None:
    """The Q/K layout convention per architecture, checked against transformers' GGUF reader."""
    hf_dir = make_tiny_hf_model(tmp_path / arch, arch, seed=2, with_tokenizer=False)
    path = write_gguf(tmp_path / "m.gguf", hf_dir)
    reference, _ = hf_state_dict(str(tmp_path), gguf_file="m.gguf")
    assert_same_weights(load_model(path), reference)


def test_gguf_tied_embeddings_and_dtype(tmp_path) -> None:
    hf_dir = make_tiny_hf_model(
        tmp_path / "q", "qwen2", tie_word_embeddings=True, with_tokenizer=False
    )
    path = write_gguf(tmp_path / "m.gguf", hf_dir, Q.F16)
    loaded = load_model(path, dtype=torch.float16)
    assert loaded.config.tie_word_embeddings
    assert "lm_head.weight" not in loaded.weights
    reference, _ = hf_state_dict(hf_dir)
    for name, tensor in loaded.weights.items():
        assert tensor.dtype == torch.float16
        # F16 storage round-trips exactly to float16
        assert torch.equal(tensor, reference[name].to(torch.float16)), name


@pytest.mark.parametrize(
    "rope",
    [
        # Llama 3.1's values: one dimension falls in the smooth band at head_dim 16
        {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        # several smooth dimensions: recovered by fitting, not by the known values
        {
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 1024,
        },
    ],
)
def test_gguf_llama3_rope_freqs(tmp_path, rope: dict) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_dir = make_tiny_hf_model(
        tmp_path / "l3",
        rope_scaling={"rope_type": "llama3", **rope},
        rope_theta=500000.0,
        max_position_embeddings=16384,
        with_tokenizer=False,
    )
    loaded = load_model(write_gguf(tmp_path / "m.gguf", hf_dir))
    scaling = loaded.config.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "llama3"
    assert scaling["factor"] == rope["factor"]

    def inv_freq(rope_parameters: dict) -> torch.Tensor:
        config = tiny_hf_config(
            "llama",
            rope_parameters={**rope_parameters, "rope_theta": 500000.0},
            max_position_embeddings=16384,
        )
        return LlamaRotaryEmbedding(config).inv_freq

    torch.testing.assert_close(inv_freq(scaling), inv_freq({"rope_type": "llama3", **rope}))


def test_gguf_metadata_fallbacks_and_linear_rope(tmp_path) -> None:
    hf_dir = make_tiny_hf_model(tmp_path / "l", with_tokenizer=False)
    path = write_gguf(
        tmp_path / "m.gguf",
        hf_dir,
        metadata={
            "llama.vocab_size": None,  # falls back to the token list
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(TINY_VOCAB_SIZE)],
            "llama.attention.key_length": None,  # falls back to hidden / heads
            "llama.rope.scaling.type": "linear",
            "llama.rope.scaling.factor": 4.0,
            "tokenizer.ggml.eot_token_id": 5,
        },
    )
    config = load_model(path).config
    assert config.vocab_size == TINY_VOCAB_SIZE
    assert config.head_dim == 16
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.eos_token_ids == [2, 5]


# ---------------------------------------------------------------- errors


def raises_load_error(path: str, *fragments: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return info.value


def test_missing_path(tmp_path) -> None:
    raises_load_error(str(tmp_path / "nope.gguf"), "nope.gguf", "no such file")


def test_not_a_model_file(tmp_path) -> None:
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    raises_load_error(str(path), "weights.txt", "expected")


def test_dir_without_config(tmp_path) -> None:
    raises_load_error(str(tmp_path), str(tmp_path), "config.json")


def test_corrupt_config_json(tmp_path) -> None:
    path = make_tiny_hf_model(tmp_path / "m", with_tokenizer=False)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"model_type": "llama",')
    error = raises_load_error(path, "config.json", "invalid JSON")
    assert isinstance(error.__cause__, json.JSONDecodeError)


def test_hf_unsupported_architecture(tmp_path) -> None:
    path = make_tiny_hf_model(tmp_path / "m", with_tokenizer=False)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    raises_load_error(path, "config.json", "unsupported architecture 'gpt2'")


def test_hf_shape_mismatch_and_missing_tensor(tmp_path) -> None:
    path = make_tiny_hf_model(tmp_path / "m", with_tokenizer=False)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        good = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**good, "intermediate_size": 96}, f)
    raises_load_error(path, "model.safetensors", "mlp.gate_proj.weight", "[128, 64]", "[96, 64]")
    with open(config_path, "w") as f:
        json.dump({**good, "num_hidden_layers": 3}, f)
    raises_load_error(path, "missing tensors", "model.layers.2.")


def test_hf_corrupt_and_missing_safetensors(tmp_path) -> None:
    path = make_tiny_hf_model(tmp_path / "m", with_tokenizer=False, max_shard_size="1MB")
    shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    shard = os.path.join(path, shards[-1])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    raises_load_error(path, shards[-1], "corrupt")
    os.remove(shard)
    raises_load_error(path, shards[-1], "missing")
    for name in os.listdir(path):
        if "safetensors" in name:
            os.remove(os.path.join(path, name))
    raises_load_error(path, "no weights found")


def test_gguf_unsupported_architecture(tmp_path) -> None:
    hf_dir = make_tiny_hf_model(tmp_path / "l", with_tokenizer=False)
    path = write_gguf(tmp_path / "gpt2.gguf", hf_dir, arch="gpt2")
    raises_load_error(path, "gpt2.gguf", "unsupported architecture 'gpt2'")


def test_gguf_missing_tensor(tmp_path) -> None:
    hf_dir = make_tiny_hf_model(tmp_path / "l", with_tokenizer=False)
    path = write_gguf(tmp_path / "m.gguf", hf_dir, drop_tensors=["blk.1.ffn_up.weight"])
    raises_load_error(path, "m.gguf", "missing tensors blk.1.ffn_up.weight")


def test_gguf_truncated(tmp_path) -> None:
    source = default_model()
    size = os.path.getsize(source)
    path = tmp_path / "half.gguf"
    with open(source, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(size // 2))
    raises_load_error(str(path), "half.gguf", "truncated", f"the file has {size // 2}")
    # cut inside the metadata (the vocabulary alone is over 1 MB)
    with open(path, "r+b") as f:
        f.truncate(100_000)
    error = raises_load_error(str(path), "half.gguf", "not a valid GGUF file")
    assert error.__cause__ is not None


def test_gguf_garbage(tmp_path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    raises_load_error(str(path), "junk.gguf", "not a valid GGUF file")
    # magic bytes without the .gguf suffix still route to the GGUF loader
    magic = tmp_path / "model.bin"
    magic.write_bytes(b"GGUF" + b"\x00" * 3)
    raises_load_error(str(magic), "model.bin", "GGUF")
