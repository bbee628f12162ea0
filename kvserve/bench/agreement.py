"""`kvserve bench agreement`: greedy tokens against transformers on the dequantized weights.

transformers loads the GGUF itself (dequantizing every tensor to float32) and decodes each
prompt greedily: the reference. kvserve decodes the same prompts with each CPU matmul mode
(`int8`: 8-bit activations, `exact`: float32 ones), and any other engine's tokens can be
read from a JSON file (`--peer NAME=FILE`, a list of token-id lists in prompt order; e.g.
llama.cpp's from scripts/llama_cpp_greedy.py, fed the prompts `--prompts-out` writes).
For each: how many prompts give the reference's tokens exactly, and the mean length of the
common prefix (where greedy decoding first picks another token).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from kvserve.bench.common import identical, write_json

# Varied prompts: facts, code, arithmetic, lists, stories, translation, other scripts; the
# last ones go through the chat template.
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three uses of copper:\n1.",
    "Translate to French: I like apples.",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Q: What is 17 times 3?\nA:",
    "Écris un poème sur la mer 🌊:",
    "import numpy as np\n\nx = np.",
    "The three primary colors are",
    "Water boils at",
    "The largest planet in our solar system is",
    "class Stack:\n    def __init__(self):",
    "SELECT name, age FROM users WHERE",
    "The theory of relativity was developed by",
    "In 1492, Christopher Columbus",
    "Photosynthesis is the process by which",
    "To make a cup of tea, first",
    "The main difference between a virus and a bacterium is",
    "Dear Sir or Madam,\n\nI am writing to",
    "1, 1, 2, 3, 5, 8, 13,",
    "The chemical symbol for gold is",
    "#include <stdio.h>\n\nint main() {",
    "A haiku about autumn:\n",
    "The best way to learn a new language is",
    "Mount Everest is located in",
    "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"",
    "The French Revolution began in",
    "Here is a recipe for pancakes. Ingredients:",
    "The speed of light is approximately",
]
CHATS = [
    "What is the boiling point of water?",
    "Give me three tips for better sleep.",
    "Explain what a hash table is in one paragraph.",
    "Write a short poem about the sea.",
    "What is 12 plus 30?",
    "Who wrote Romeo and Juliet?",
    "What is the capital of France?",
]


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("agreement", help="greedy tokens against transformers (dequantized GGUF)")
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--modes", default="int8,exact", help="kvserve cpu_matmul modes (comma list)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--peer", action="append", default=[], metavar="NAME=FILE",
                   help="another engine's tokens (JSON list of token-id lists, prompt order)")
    p.add_argument("--prompts-out", default=None, metavar="FILE",
                   help="write the prompts' token ids (JSON) for another engine, then go on")
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=cmd_agreement)


def prompts(tokenizer: Any) -> list[list[int]]:
    """The prompts' token ids: the texts as they are, the chats through the chat template."""
    out = [tokenizer.encode(t) for t in TEXTS]
    out += [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                          tokenize=True) for c in CHATS]
    return out


def reference(path: str, ids: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens on its own float32 load of the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in ids:
            gen = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=model.config.eos_token_id)
            out.append(gen[0, len(p):].tolist())
    return out


def kvserve_tokens(path: str, ids: list[list[int]], n: int, mode: str,
                   threads: int | None) -> list[list[int]]:
    from kvserve import LLM, SamplingParams

    kw = {"num_threads": threads} if threads else {}
    llm = LLM(path, cpu_matmul=mode, host_cache_gib=0, **kw)
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outs]


def cmd_agreement(a: argparse.Namespace) -> int:
    import torch

    from kvserve.bench.common import machine_info
    from kvserve.models import resolve_model
    from kvserve.workers.loading.tokenizer import load_tokenizer

    if a.threads:
        torch.set_num_threads(a.threads)
    path = resolve_model(a.model)
    ids = prompts(load_tokenizer(path))
    if a.prompts_out:
        with open(a.prompts_out, "w", encoding="utf-8") as f:
            json.dump(ids, f)
    ref = reference(path, ids, a.tokens)
    rows: dict[str, dict[str, Any]] = {}
    for mode in [m for m in a.modes.split(",") if m]:
        rows[f"kvserve {mode}"] = identical(ref, kvserve_tokens(path, ids, a.tokens, mode, a.threads))
    for spec in a.peer:
        name, _, file = spec.partition("=")
        with open(file, encoding="utf-8") as f:
            peer = json.load(f)
        if len(peer) != len(ids):
            raise SystemExit(f"{file}: {len(peer)} token lists for {len(ids)} prompts")
        rows[name] = identical(ref, [t[: a.tokens] for t in peer])
    print(f"{len(ids)} prompts, {a.tokens} greedy tokens each, against transformers on the "
          "dequantized weights")
    print("| engine | same tokens | mean common prefix |")
    print("|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['identical']}/{r['of']} | {r['mean_common_prefix']:.1f} |")
    write_json(a.json, {"machine": machine_info(torch.get_num_threads()), "model": path,
                        "tokens": a.tokens, "results": rows})
    return 0
