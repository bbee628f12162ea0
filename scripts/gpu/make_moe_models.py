"""Random-weight Qwen3-MoE models with SmolLM2's tokenizer, saved as HF directories (bf16
safetensors, one tensor per expert as published checkpoints hold them), the way
make_models.py (GPU_SHARED) makes its Llama shapes.

Usage (on a GPU host with transformers): python make_moe_models.py OUT_DIR TOKENIZER_DIR [q3moe]
  q3moe: Qwen3-30B-A3B's layer shape at a third of its depth and half its experts: hidden
         2048, 16 layers, 32/4 heads of 128, 64 experts of width 768, top-8 renormalised,
         vocab 49152: 5.2B parameters, 1.0B active per token (10.5 GB in bf16)
Weights are drawn with a fixed seed and a wider spread than transformers' default, so that
logits are not flat, routing is decisive and greedy comparisons mean something.
"""
import os
import shutil
import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SHAPES = {
    "q3moe": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64,
                  num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}


def make(out_root: str, tokenizer: str, name: str) -> str:
    out = os.path.join(out_root, name)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    cfg = Qwen3MoeConfig(vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, **SHAPES[name])
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:  # experts are [E, out, in]
                p.normal_(0, 0.05 if "embed" in pname else 0.03)
    model.save_pretrained(out)
    for f in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, f), out)
    return out


if __name__ == "__main__":
    root, tok, names = sys.argv[1], sys.argv[2], sys.argv[3:] or ["q3moe"]
    for n in names:
        print("ready:", make(root, tok, n))
