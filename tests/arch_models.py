"""Tiny random models of the newer dense families (Qwen3, Gemma 2, Gemma 3, Phi-3) for tests:
HF directories written by transformers (sharded, with model.safetensors.index.json, and a
chat template of the family's style), and the same weights converted to GGUF the way
llama.cpp lays these architectures out (its tensor names and metadata keys, written out
here rather than taken from kvserve's loader or the gguf package's name maps, so the
loader is checked against an independent view).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import numpy as np
import torch
from tiny_models import TINY_VOCAB_SIZE, save_tokenizer

ARCHS = ("qwen3", "gemma2", "gemma3", "phi3")

# Each family's chat template, in the style its published models ship (written for these
# tests: the role markers, BOS handling and system-prompt rules of the family).
CHAT_TEMPLATES = {
    "qwen3": (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message.role + '\\n' }}"
        "{%- if message.role == 'assistant' and message.reasoning_content is defined %}"
        "{{- '<think>\\n' + message.reasoning_content.strip() + '\\n</think>\\n\\n' }}"
        "{%- endif %}"
        "{{- message.content + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
    ),
    "gemma2": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
    ),
    "gemma3": (
        "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
        "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
        "{%- set loop_messages = messages[1:] -%}{%- else -%}"
        "{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
        "{%- for message in loop_messages -%}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
        "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
        "{%- else -%}{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
    ),
    "phi3": (
        "{% for message in messages %}"
        "{% if message['role'] == 'system' and message['content'] %}"
        "{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
    ),
}

_HF_CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
WINDOW = 16  # the sliding window of the tiny Gemma and Phi-3 models, in tokens

# What makes each tiny model exercise its family: explicit head_dim wider than hidden / heads
# (Qwen3), a q scale other than 1/sqrt(head_dim), both soft-caps, windows, per-layer RoPE
# bases with linear scaling on the global layers (Gemma 3), partial rotary and LongRoPE with a
# pre-training context of 64 (Phi-3).
_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True, "rope_parameters":
              {"rope_type": "default", "rope_theta": 1e6}},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
               "tie_word_embeddings": True, "rope_parameters":
               {"rope_type": "default", "rope_theta": 10000.0}},
    "gemma3": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
               "sliding_window_pattern": 2, "final_logit_softcapping": 5.0,
               "tie_word_embeddings": True, "rope_parameters": {
                   "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "phi3": {"sliding_window": WINDOW, "max_position_embeddings": 256,
             "original_max_position_embeddings": 64, "rope_parameters": {
                 "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                 "short_factor": [1.0, 1.1, 1.5, 2.0], "long_factor": [1.0, 2.0, 4.0, 8.0]}},
}


def tiny_arch_config(arch: str, **overrides: Any) -> Any:
    import transformers

    kwargs: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0,
    }
    kwargs.update(_CONFIGS[arch])
    kwargs.update(overrides)
    return getattr(transformers, _HF_CLASSES[arch][0])(**kwargs)


def hf_class(arch: str) -> Any:
    import transformers

    return getattr(transformers, _HF_CLASSES[arch][1])


def make_arch_model(path: str | os.PathLike[str], arch: str, seed: int = 0,
                    with_tokenizer: bool = True, **overrides: Any) -> str:
    """A tiny random float32 model of `arch`, in sharded safetensors, with the SmolLM2
    tokenizer and the family's chat template."""
    config = tiny_arch_config(arch, **overrides)
    torch.manual_seed(seed)
    model = hf_class(arch)(config).eval()
    with torch.no_grad():  # norms start at 1 (Gemma: at 0) and biases at 0: perturb all
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    path = os.fspath(path)
    model.save_pretrained(path, max_shard_size="2MB")  # several shards and an index
    if with_tokenizer:
        save_tokenizer(path)
        config_path = os.path.join(path, "tokenizer_config.json")
        with open(config_path, encoding="utf-8") as f:
            tok_config = json.load(f)
        tok_config["chat_template"] = CHAT_TEMPLATES[arch]
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(tok_config, f, indent=2, ensure_ascii=False)
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja):  # transformers 5 prefers this file: keep one template
            os.remove(jinja)
    return path


# ---- GGUF, as llama.cpp's converter lays these architectures out -------------------------
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_ATTN = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.qkv_proj.weight": "attn_qkv.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3: gate and up stay fused in ffn_up
         "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight"}
# HF's post_attention_layernorm is llama.cpp's ffn_norm where it feeds the MLP (Qwen3,
# Phi-3), but Gemma's sits after attention; Gemma's pre-MLP norm is the ffn_norm there.
_NORMS = {
    "plain": {"post_attention_layernorm.weight": "ffn_norm.weight"},
    "gemma": {"post_attention_layernorm.weight": "post_attention_norm.weight",
              "pre_feedforward_layernorm.weight": "ffn_norm.weight",
              "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
}


def gguf_tensor_name(arch: str, hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    table = {**_ATTN, **_NORMS["gemma" if arch.startswith("gemma") else "plain"]}
    return f"blk.{layer}.{table[rest]}"


@functools.lru_cache(maxsize=1)
def _tokenizer_fields() -> dict[str, Any]:
    """The default GGUF's tokenizer metadata, so a converted tiny model carries the same
    tokenizer as its HF directory (read with kvserve's header-only reader: gguf's full
    reader takes tens of seconds over a 49k-token vocabulary on a loaded machine)."""
    from kvserve.models import default_model
    from kvserve.workers.loading.tokenizer import _read_gguf_metadata

    meta = _read_gguf_metadata(default_model())
    return {k: v for k, v in meta.items()
            if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}


def write_arch_gguf(path: str | os.PathLike[str], hf_dir: str, arch: str, qtype: Any = None) -> str:
    """Convert the tiny HF model in `hf_dir` to a GGUF with llama.cpp's names and keys: float32,
    or its 2-D weights in `qtype` (a gguf.GGMLQuantizationType) as llama.cpp's quantizer
    leaves norms and rope factors float32."""
    import gguf
    from tiny_models import quantize_blocks

    cfg = json.load(open(os.path.join(hf_dir, "config.json"), encoding="utf-8"))
    model = hf_class(arch).from_pretrained(hf_dir, dtype=torch.float32)
    hc = model.config
    head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_name(os.path.basename(os.path.normpath(hf_dir)))
    writer.add_block_count(hc.num_hidden_layers)
    writer.add_context_length(hc.max_position_embeddings)
    writer.add_embedding_length(hc.hidden_size)
    writer.add_feed_forward_length(hc.intermediate_size)
    writer.add_head_count(hc.num_attention_heads)
    writer.add_head_count_kv(hc.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(hc.rms_norm_eps)
    writer.add_vocab_size(hc.vocab_size)
    rope = cfg["rope_parameters"]
    if arch == "gemma3":
        glob = rope["full_attention"]
        writer.add_rope_freq_base(glob["rope_theta"])
        writer.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
        if glob.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(glob["factor"])
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    rot = int(head_dim * rope.get("partial_rotary_factor", 1.0)) if arch == "phi3" else head_dim
    writer.add_rope_dimension_count(rot)
    if cfg.get("sliding_window"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_float32(f"{arch}.attn_logit_softcapping", cfg["attn_logit_softcapping"])
    if arch in ("gemma2", "gemma3") and cfg.get("final_logit_softcapping") is not None:
        writer.add_float32(f"{arch}.final_logit_softcapping", cfg["final_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        # llama.cpp knows no query_pre_attn_scalar; a converter can state the q scale
        writer.add_float32(f"{arch}.attention.scale", cfg["query_pre_attn_scalar"] ** -0.5)
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern", cfg["sliding_window_pattern"])
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        original = cfg["original_max_position_embeddings"]
        scale = hc.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    writer.add_bos_token_id(hc.bos_token_id)
    writer.add_eos_token_id(hc.eos_token_id)
    for key, value in _tokenizer_fields().items():
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
    writer.add_chat_template(CHAT_TEMPLATES[arch])

    state = model.state_dict()
    if hc.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # llama.cpp omits output.weight when tied
    for hf_name, tensor in state.items():
        array = tensor.detach().numpy().astype(np.float32)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's Gemma norms hold 1 + w
        if qtype is not None and array.ndim == 2:
            writer.add_tensor(gguf_tensor_name(arch, hf_name), quantize_blocks(array, qtype),
                              raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_tensor_name(arch, hf_name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)
