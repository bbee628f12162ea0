"""Tiny random models for tests: HF directories built with transformers, and GGUF files.

The helpers deliberately do not use kvserve's loaders, so tests can compare
kvserve's view of a model against an independent one.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The real SmolLM2 vocabulary, so token ids line up with the real tokenizer.
TINY_VOCAB_SIZE = 49152

# transformers config classes by our architecture name
_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}

# Llama 3.1's published rope scaling; "llama3" picks these in make_tiny_hf_model.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """The SmolLM2 tokenizer as transformers builds it from the default GGUF (slow: cached), or
    from the HF directory in `KVSERVE_TEST_TOKENIZER` (a GPU host without the default model)."""
    from transformers import AutoTokenizer

    if os.environ.get("KVSERVE_TEST_TOKENIZER"):
        return AutoTokenizer.from_pretrained(os.environ["KVSERVE_TEST_TOKENIZER"])
    from kvserve.models import default_model

    folder, name = os.path.split(default_model())
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def save_tokenizer(path: str) -> None:
    """Write tokenizer.json and tokenizer_config.json (with chat_template) into `path`."""
    tokenizer = smollm2_tokenizer()
    tokenizer.save_pretrained(path)
    # transformers 5 writes the template to chat_template.jinja only; many published
    # models carry it in tokenizer_config.json, so put it there as well.
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["chat_template"] = tokenizer.chat_template
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def tiny_hf_config(arch: str = "llama", **overrides: Any) -> Any:
    """A small transformers config for `arch`; overrides are config keyword arguments."""
    import transformers

    if arch not in _HF_CLASSES:
        raise ValueError(f"unknown arch {arch!r}")
    kwargs: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    kwargs.update(overrides)
    return getattr(transformers, _HF_CLASSES[arch][0])(**kwargs)


def make_tiny_hf_model(
    path: str | os.PathLike[str],
    arch: str = "llama",
    seed: int = 0,
    *,
    rope_scaling: str | dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_shard_size: str | int | None = None,
    with_tokenizer: bool = True,
    **overrides: Any,
) -> str:
    """Write a tiny random float32 model directory for `arch` and return its path.

    rope_scaling: None, "llama3" (Llama 3.1 values, theta 500000) or an HF-style dict.
    max_shard_size: e.g. "1MB" to get sharded safetensors with an index.
    overrides: config keyword arguments, e.g. tie_word_embeddings=True.
    """
    import transformers

    if rope_scaling == "llama3":
        rope_scaling, rope_theta = dict(LLAMA3_ROPE), 500000.0
        # like Llama 3.1: the scaled context is `factor` times the original one
        overrides.setdefault("max_position_embeddings", 65536)
    rope = {"rope_type": "default"} if rope_scaling is None else dict(rope_scaling)
    rope["rope_theta"] = rope_theta
    config = tiny_hf_config(arch, rope_parameters=rope, **overrides)

    torch.manual_seed(seed)
    model = getattr(transformers, _HF_CLASSES[arch][1])(config).eval()
    with torch.no_grad():
        # HF initialises norms to 1 and biases to 0; perturb everything so that a
        # swapped or dropped tensor shows up in comparisons.
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    path = os.fspath(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if with_tokenizer:
        save_tokenizer(path)
    return path


# HF name (inside model.layers.{i}.) -> llama.cpp name (inside blk.{i}.)
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for an HF Llama tensor name."""
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"


def permute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp converter's Q/K row order: each head's two rotary halves interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_freqs(hf_config: Any) -> np.ndarray:
    """Per-dimension frequency divisors as llama.cpp stores them in rope_freqs.weight,
    derived from transformers' own llama3 RoPE so the test does not restate the formula."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaled = LlamaRotaryEmbedding(hf_config).inv_freq.double()
    base, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    return (base.double() / scaled).numpy().astype(np.float32)


def write_gguf(
    path: str | os.PathLike[str],
    hf_dir: str,
    qtype: Any = None,
    *,
    arch: str | None = None,
    metadata: dict[str, Any] | None = None,
    drop_tensors: Iterable[str] = (),
) -> str:
    """Convert the HF model in `hf_dir` into a GGUF file the way llama.cpp lays it out.

    qtype: gguf.GGMLQuantizationType for 2-D weights (F32 default), or a function of the
    GGUF tensor name and float array giving each one's type (a mixed file, as llama.cpp's
    Q4_K_M); norms and biases stay F32 as llama.cpp keeps them. arch: GGUF architecture; defaults to "llama"
    for llama/mistral (as llama.cpp writes them) and "qwen2" for qwen2.
    metadata: extra or replacement key/values; a None value removes a key.
    drop_tensors: GGUF tensor names to leave out.
    """
    import gguf
    from transformers import AutoModelForCausalLM

    pick = qtype if callable(qtype) else (lambda name, array, t=qtype: t)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = model.config
    arch = arch or ("qwen2" if cfg.model_type == "qwen2" else "llama")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = dict(cfg.rope_parameters or {})

    meta: dict[str, Any] = {
        "general.name": os.path.basename(os.path.normpath(hf_dir)),
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.rope.freq_base": float(rope.get("rope_theta", 10000.0)),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.vocab_size": cfg.vocab_size,
        "tokenizer.ggml.bos_token_id": cfg.bos_token_id,
        "tokenizer.ggml.eos_token_id": cfg.eos_token_id,
    }
    if rope.get("rope_type") == "linear":
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = float(rope["factor"])
    meta.update(metadata or {})

    writer = gguf.GGUFWriter(os.fspath(path), arch)
    for key, value in meta.items():
        if value is None or key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value) if value >= 0 else writer.add_int32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))

    dropped = set(drop_tensors)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # llama.cpp omits output.weight when tied
    for hf_name, tensor in state.items():
        name = gguf_name(hf_name)
        if name in dropped:
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if arch in ("llama", "mistral") and hf_name.endswith("q_proj.weight"):
            array = permute_qk(array, cfg.num_attention_heads)
        elif arch in ("llama", "mistral") and hf_name.endswith("k_proj.weight"):
            array = permute_qk(array, cfg.num_key_value_heads)
        qt = gguf.GGMLQuantizationType.F32 if array.ndim == 1 else pick(name, array)
        if qt is None or qt == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif qt == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, quantize_blocks(array, qt), raw_dtype=qt)
    if rope.get("rope_type") == "llama3" and "rope_freqs.weight" not in dropped:
        # llama.cpp keeps no llama3 metadata, only the precomputed per-dimension factors.
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


def quantize_k(array: np.ndarray, qtype: Any) -> np.ndarray:
    """Q3_K, Q4_K, Q5_K or Q6_K blocks of a 2-D float array ([rows, cols], cols a multiple of 256) as raw
    bytes [rows, cols / 256 * block bytes], quantized plainly (no search for the best scales,
    as llama.cpp does: these only need to be valid blocks for tests)."""
    import gguf

    rows, cols = array.shape
    x = array.astype(np.float32).reshape(-1, 256)
    n = x.shape[0]
    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        top = 15 if qtype == gguf.GGMLQuantizationType.Q4_K else 31
        sub = x.reshape(n, 8, 32)
        lo = np.minimum(sub.min(-1), 0)  # the min is -dmin * m with m >= 0
        scale = (sub.max(-1) - lo) / top
        d = np.maximum(scale.max(-1, keepdims=True) / 63, 1e-8).astype(np.float16).astype(np.float32)
        dmin = np.maximum((-lo).max(-1, keepdims=True) / 63, 1e-8).astype(np.float16).astype(np.float32)
        sc = np.clip(np.rint(scale / d), 1, 63).astype(np.uint8)
        m = np.clip(np.rint(-lo / dmin), 0, 63).astype(np.uint8)
        eff_d = (d * sc)[..., None]
        q = np.clip(np.rint((sub + (dmin * m)[..., None]) / eff_d), 0, top).astype(np.uint8)
        scales = np.zeros((n, 12), np.uint8)
        scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
        scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
        scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
        high = [] if top == 15 else [((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8)]
        q = (q & 15).reshape(n, 4, 2, 32)  # Q5_K: bit j of qh[l] is slice j's fifth bit of weight l
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
        blocks = np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8),
                                 scales, *high, qs], axis=1)
    elif qtype == gguf.GGMLQuantizationType.Q6_K:
        sub = x.reshape(n, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = np.maximum(scale.max(-1, keepdims=True) / 127, 1e-8).astype(np.float16).astype(np.float32)
        sc = np.clip(np.rint(scale / d), 1, 127).astype(np.int8)
        q = np.clip(np.rint(sub / (d * sc)[..., None]), -32, 31).astype(np.int16) + 32
        q = q.reshape(n, 2, 4, 32).astype(np.uint8)  # half, quarter, 32 values
        lo = q & 15
        ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        blocks = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                                 d.astype(np.float16).view(np.uint8)], axis=1)
    elif qtype == gguf.GGMLQuantizationType.Q3_K:  # d * (sc - 32) * (q - 4) per 16 weights
        sub = x.reshape(n, 16, 16)
        scale = np.abs(sub).max(-1) / 4
        d = np.maximum(scale.max(-1, keepdims=True) / 31, 1e-8).astype(np.float16).astype(np.float32)
        sc = np.clip(np.rint(scale / d), 1, 31).astype(np.int16)
        q = np.clip(np.rint(sub / (d * sc)[..., None]), -4, 3).astype(np.int16).reshape(n, 256) + 4
        sc6 = (sc + 32).astype(np.uint8)  # 6 bits: low nibbles in bytes 0-7, top 2 in 8-11
        scales = np.concatenate([(sc6[:, :8] & 15) | ((sc6[:, 8:] & 15) << 4),
                                 sum(((sc6[:, 4 * k:4 * k + 4] >> 4) << (2 * k)) for k in range(4))], axis=1)
        q = q.reshape(n, 2, 4, 32).astype(np.uint8)  # half, pair of bits in qs, 32 weights
        qs = sum(((q[:, :, j] & 3) << (2 * j)) for j in range(4)).reshape(n, 64)
        hmask = sum(((q[:, h, j] >> 2) << (4 * h + j)) for h in range(2) for j in range(4))
        blocks = np.concatenate([hmask.astype(np.uint8), qs.astype(np.uint8), scales.astype(np.uint8),
                                 d.astype(np.float16).view(np.uint8)], axis=1)
    else:
        raise ValueError(f"not a K-quant: {qtype}")
    return blocks.reshape(rows, -1)


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.float32)


def quantize_iq4_nl(array: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of a 2-D float array (cols a multiple of 32): per 32 weights an f16
    scale that takes the largest magnitude to -127, each weight the nearest table value."""
    rows, cols = array.shape
    x = array.astype(np.float32).reshape(-1, 32)
    big = np.take_along_axis(x, np.abs(x).argmax(-1, keepdims=True), -1)
    d = (big / -127).astype(np.float16)
    df = d.astype(np.float32)
    idx = np.abs(x[..., None] - df[..., None] * IQ4_NL_VALUES).argmin(-1).astype(np.uint8)
    qs = idx[:, :16] | (idx[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8), qs], axis=1).reshape(rows, -1)


def quantize_blocks(array: np.ndarray, qtype: Any) -> np.ndarray:
    """Raw ggml blocks of a 2-D float array: gguf's quantizer, or quantize_k for Q3_K / Q4_K /
    Q5_K / Q6_K and quantize_iq4_nl (gguf has no quantizer for these)."""
    import gguf

    T = gguf.GGMLQuantizationType
    if qtype in (T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        return quantize_k(array, qtype)
    if qtype == gguf.GGMLQuantizationType.IQ4_NL:
        return quantize_iq4_nl(array)
    return gguf.quants.quantize(array, qtype)


def llama_cpp_mix(ftype: str, n_layer: int, tied: bool = False) -> Any:
    """A `write_gguf` pick giving each tensor the type llama.cpp's quantizer gives it in a
    Q3_K_M, Q4_K_M or Q5_K_M file of a dense Llama-like model with `n_layer` layers (its
    `use_more_bits` layers get more bits in `attn_v` and `ffn_down`), with its fallbacks
    where a row is no multiple of 256 weights: Q3_K -> IQ4_NL, Q4_K -> Q5_0, Q5_K -> Q5_1,
    Q6_K -> Q8_0. `tied`: the embedding is also the output head, typed as the head."""
    import gguf

    T = gguf.GGMLQuantizationType
    base = {"Q3_K_M": T.Q3_K, "Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K}[ftype]
    fallback = {T.Q3_K: T.IQ4_NL, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

    def more_bits(i: int) -> bool:
        return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2

    def pick(name: str, array: np.ndarray) -> Any:
        parts = name.split(".")
        i = int(parts[1]) if parts[0] == "blk" else -1
        if name.startswith("output") or (tied and name.startswith("token_embd")):
            t = T.Q6_K
        elif base == T.Q3_K and "attn_v" in name:
            t = T.Q5_K if i < 2 else T.Q4_K
        elif base == T.Q3_K and "attn_output" in name:
            t = T.Q4_K
        elif base == T.Q3_K and "ffn_down" in name:
            t = T.Q5_K if i < n_layer // 16 else T.Q4_K if more_bits(i) else T.Q3_K
        elif ("attn_v" in name or "ffn_down" in name) and more_bits(i):
            t = T.Q6_K
        else:
            t = base
        return fallback.get(t, t) if array.shape[1] % 256 else t

    return pick


def tiny_model_path(tmp_path_factory) -> str:
    """One tiny random Llama with the SmolLM2 tokenizer, built once per test session."""
    path = tmp_path_factory.getbasetemp() / "tiny_host_model"
    if not (path / "config.json").exists():
        make_tiny_hf_model(path, "llama", seed=7)
    return str(path)
