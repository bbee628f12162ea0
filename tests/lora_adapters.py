"""Tiny random LoRA adapters made by PEFT itself, and PEFT's greedy tokens as the oracle.

PEFT initialises lora_B to zeros (an adapter that changes nothing); `init_lora_weights=False`
gives random A and B, and the B matrices are scaled up so each adapter visibly changes the
base model's tokens.
"""

from __future__ import annotations

import os
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: str, path: str, rank: int, seed: int,
                 targets: list[str] | None = None, alpha: float | None = None,
                 scale_b: float = 4.0, **config: Any) -> str:
    """Write a PEFT LoRA adapter of `rank` for the HF model in `base_dir` into `path`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                     target_modules=targets or ALL, init_lora_weights=False,
                     lora_dropout=0.0, **config)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale_b)
    model.save_pretrained(path)
    return path


def peft_greedy(base_dir: str, adapters: dict[str, str], prompts: list[list[int]],
                max_tokens: int) -> dict[str | None, list[list[int]]]:
    """PEFT + transformers greedy continuations of each prompt, one prompt at a time (no
    padding, no EOS stop), per adapter name and for the base model (key None). The base is
    loaded once and PEFT switches adapters on it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    out: dict[str | None, list[list[int]]] = {None: _greedy(model, prompts, max_tokens)}
    if not adapters:
        return out
    from peft import PeftModel

    names = list(adapters)
    peft = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        peft.load_adapter(adapters[name], adapter_name=name)
    for name in names:
        peft.set_adapter(name)
        out[name] = _greedy(peft, prompts, max_tokens)
    return out


def _greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            res = model(torch.tensor([seq]), use_cache=True)
            for _ in range(max_tokens):
                seq.append(int(res.logits[0, -1].argmax()))
                res = model(torch.tensor([[seq[-1]]]), past_key_values=res.past_key_values,
                            use_cache=True)
            out.append(seq[len(ids):])
    return out


def write_adapter(path: str, num_layers: int, hidden: int, q: int, kv: int, inter: int,
                  rank: int, seed: int, targets: list[str] | None = None,
                  scale: float = 0.2) -> str:
    """A PEFT-format LoRA adapter written directly (no base model loaded): random A and B of
    `rank` for `targets` in every layer, PEFT's file names, keys and config."""
    import json

    from safetensors.torch import save_file

    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    targets = targets or ALL
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_layers):
        for m in targets:
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fan_in, fan_out = shapes[m]
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": targets, "bias": "none", "task_type": "CAUSAL_LM"}, f)
    return path


def smollm2_adapter(path: str, rank: int, seed: int, targets: list[str] | None = None) -> str:
    """An adapter for the default model (SmolLM2-135M: 30 layers, hidden 576, 9 query and 3
    KV heads of 64, MLP 1536)."""
    return write_adapter(path, 30, 576, 576, 192, 1536, rank, seed, targets)
