"""Tiny random Mixture-of-Experts models for tests: Qwen3-MoE and Mixtral HF directories
written by transformers (sharded, with model.safetensors.index.json, the experts one tensor
each as published checkpoints hold them), and the same weights converted to GGUF the way
llama.cpp lays these architectures out (Qwen3-MoE as `qwen3moe`, Mixtral as `llama` with
`expert_count`; experts stacked in `ffn_{gate,up,down}_exps`, the router in `ffn_gate_inp`),
written out here rather than taken from kvserve's loader.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from arch_models import CHAT_TEMPLATES, _tokenizer_fields
from tiny_models import TINY_VOCAB_SIZE, permute_qk, save_tokenizer

# Mixtral-Instruct's style: [INST] turns, BOS once, user/assistant alternating, no system role
MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

# variant -> (architecture, config keyword arguments)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # 8 experts, top-2, weights renormalised, every layer sparse
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True,
                                "head_dim": 32, "tie_word_embeddings": True}),
    # raw top-k probabilities, and a dense middle layer among sparse ones
    "qwen3_moe_dense": ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 32, "norm_topk_prob": False,
                                      "num_hidden_layers": 3, "mlp_only_layers": [1],
                                      "head_dim": 16, "tie_word_embeddings": False}),
    # 4 experts, top-2; Mixtral's experts are intermediate_size wide
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                            "intermediate_size": 48, "tie_word_embeddings": False}),
}
_CLASSES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "mixtral": ("MixtralConfig", "MixtralForCausalLM")}


def arch_of(variant: str) -> str:
    return VARIANTS[variant][0]


def chat_template(variant: str) -> str:
    return CHAT_TEMPLATES["qwen3"] if arch_of(variant) == "qwen3_moe" else MIXTRAL_TEMPLATE


def hf_class(variant: str) -> Any:
    import transformers

    return getattr(transformers, _CLASSES[arch_of(variant)][1])


def tiny_moe_config(variant: str) -> Any:
    import transformers

    arch, extra = VARIANTS[variant]
    kwargs: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6 if arch == "qwen3_moe" else 1e4},
    }
    kwargs.update(extra)
    return getattr(transformers, _CLASSES[arch][0])(**kwargs)


def make_moe_model(path: str | os.PathLike[str], variant: str, seed: int = 0) -> str:
    """A tiny random float32 MoE model in sharded safetensors with the SmolLM2 tokenizer and
    the family's chat template. Routers and experts get a wide spread, so routing is decisive,
    uneven and the experts' outputs move the logits."""
    config = tiny_moe_config(variant)
    torch.manual_seed(seed)
    model = hf_class(variant)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".mlp.gate.weight"):
                param.copy_(torch.randn_like(param) * 0.3)  # the router
            elif ".experts." in name:
                param.copy_(torch.randn_like(param) * 0.15)
            else:
                param.add_(torch.randn_like(param) * 0.02)
    path = os.fspath(path)
    model.save_pretrained(path, max_shard_size="2MB")  # several shards and an index
    save_tokenizer(path)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = chat_template(variant)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2, ensure_ascii=False)
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja):  # transformers 5 prefers this file: keep one template
        os.remove(jinja)
    return path


# ---- GGUF, as llama.cpp's converter lays these architectures out -------------------------
_NAMES = {"self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
          "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
          "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
          "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
          "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
          "mlp.down_proj.weight": "ffn_down", "mlp.gate.weight": "ffn_gate_inp",
          "mlp.experts.down_proj": "ffn_down_exps"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _gguf_tensors(state: dict[str, torch.Tensor], f: int) -> dict[str, np.ndarray]:
    """llama.cpp's tensors from transformers' in-memory state (experts fused [gate | up])."""
    out = {}
    for hf_name, tensor in state.items():
        array = tensor.detach().numpy().astype(np.float32)
        if hf_name in _GLOBAL:
            out[_GLOBAL[hf_name]] = array
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            out[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(array[:, :f])
            out[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(array[:, f:])
        else:
            out[f"blk.{layer}.{_NAMES[rest]}.weight"] = array
    return out


def write_moe_gguf(path: str | os.PathLike[str], hf_dir: str, variant: str,
                   qtype: Any = None, tokenizer: bool = True) -> str:
    """Convert the tiny HF model in `hf_dir` to a GGUF with llama.cpp's names and keys; `qtype`
    quantizes the 2-D and 3-D weights (gguf.GGMLQuantizationType; float32 by default);
    `tokenizer=False` leaves the tokenizer out (a file only the loader reads)."""
    import gguf

    arch = arch_of(variant)
    model = hf_class(variant).from_pretrained(hf_dir, dtype=torch.float32)
    hc = model.config
    mixtral = arch == "mixtral"
    g_arch = "llama" if mixtral else "qwen3moe"
    head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    width = hc.intermediate_size if mixtral else hc.moe_intermediate_size
    writer = gguf.GGUFWriter(os.fspath(path), g_arch)
    writer.add_name(os.path.basename(os.path.normpath(hf_dir)))
    writer.add_block_count(hc.num_hidden_layers)
    writer.add_context_length(hc.max_position_embeddings)
    writer.add_embedding_length(hc.hidden_size)
    writer.add_feed_forward_length(hc.intermediate_size)
    writer.add_head_count(hc.num_attention_heads)
    writer.add_head_count_kv(hc.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(hc.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(hc.rms_norm_eps)
    writer.add_vocab_size(hc.vocab_size)
    writer.add_expert_count(hc.num_local_experts if mixtral else hc.num_experts)
    writer.add_expert_used_count(hc.num_experts_per_tok)
    if not mixtral:
        writer.add_expert_feed_forward_length(width)
        if not hc.norm_topk_prob:  # llama.cpp renormalises unless told otherwise
            writer.add_expert_weights_norm(False)
    writer.add_bos_token_id(hc.bos_token_id)
    writer.add_eos_token_id(hc.eos_token_id)
    for key, value in (_tokenizer_fields() if tokenizer else {}).items():
        if key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)
    if tokenizer:
        writer.add_chat_template(chat_template(variant))

    state = model.state_dict()
    if hc.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # llama.cpp omits output.weight when tied
    for name, array in _gguf_tensors(state, width).items():
        if mixtral and name.endswith(("attn_q.weight", "attn_k.weight")):  # Llama's Q/K order
            heads = hc.num_attention_heads if "attn_q" in name else hc.num_key_value_heads
            array = permute_qk(array, heads)
        if qtype is None or array.ndim == 1 or name in ("token_embd.weight", "output.weight"):
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)
