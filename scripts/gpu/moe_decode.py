"""Decode of an MoE model on one GPU: kvserve (fused-MoE kernels, CUDA graphs) against
transformers, bf16, B = 1 and 64 streams of 128 random prompt tokens, 64 greedy tokens each.

Usage: python scripts/gpu/moe_decode.py MODEL_DIR [--batches 1,64]
Prints per engine and B the decode time per step (prefill excluded: the clock starts once
every stream has its first token) and output tokens/s, then how many of the B streams give
the same greedy tokens in both engines and the mean length of their common prefix (bf16:
the two engines round differently, so long outputs may part after a near tie). A third row
runs kvserve with the grouped torch MoE path (eager, it syncs), to place the kernel.
"""

from __future__ import annotations

import argparse
import time

import torch

PROMPT, NEW = 128, 64


def prompts(b: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(b)
    return torch.randint(100, vocab - 100, (b, PROMPT), generator=g).tolist()


def kvserve_decode(llm, ps: list[list[int]]) -> tuple[float, list[list[int]]]:
    """(decode ms per step, tokens) through the engine's own step loop."""
    from kvserve import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in ps]
    done: dict[str, list[int]] = {}
    started, steps = None, 0
    while eng.has_unfinished():
        outs = eng.step()
        for o in outs:
            if o.finished:
                done[o.request_id] = o.token_ids
        running = eng.scheduler.running
        if started is None and not eng.scheduler.waiting and all(s.output_ids for s in running):
            torch.cuda.synchronize()
            started = time.perf_counter()
        elif started is not None:
            steps += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / max(steps, 1) * 1e3, [done[i] for i in ids]


def hf_decode(model, ps: list[list[int]]) -> tuple[float, list[list[int]]]:
    """(decode ms per step, tokens): generate for NEW tokens minus generate for one."""
    ids = torch.tensor(ps, device="cuda")

    def gen(n: int) -> tuple[float, torch.Tensor]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    gen(2)  # warm-up
    t1, _ = gen(1)
    tn, out = gen(NEW)
    return (tn - t1) / (NEW - 1) * 1e3, out[:, PROMPT:].tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    common = [next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x)) for x, y in zip(a, b, strict=True)]
    return f"{same}/{len(a)} identical, common prefix {sum(common) / len(common):.1f}/{NEW} tokens"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,64")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    from kvserve import LLM
    from kvserve.workers.model.layers.moe import SparseMoE

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=max(batches),
              kv_cache_tokens=max(batches) * (PROMPT + NEW + 16))
    vocab = llm.engine.model_config.vocab_size
    rows: dict[tuple[str, int], tuple[float, list[list[int]]]] = {}
    for b in batches:
        kvserve_decode(llm, prompts(b, vocab)[:2])  # warm-up
        rows["kvserve", b] = kvserve_decode(llm, prompts(b, vocab))
    del llm
    torch.cuda.empty_cache()
    eager = LLM(args.model, dtype="bfloat16", max_num_seqs=max(batches), enforce_eager=True,
                kv_cache_tokens=max(batches) * (PROMPT + NEW + 16))
    for layer in eager.engine.runner.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.kernel = False  # the grouped torch path
    for b in batches:
        kvserve_decode(eager, prompts(b, vocab)[:2])
        rows["kvserve grouped eager", b] = kvserve_decode(eager, prompts(b, vocab))
    del eager
    torch.cuda.empty_cache()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    for b in batches:
        with torch.inference_mode():
            rows["transformers", b] = hf_decode(model, prompts(b, vocab))
    print(f"{'engine':<24}{'B':>4}{'ms/step':>10}{'out tok/s':>11}")
    for (name, b), (ms, _) in rows.items():
        print(f"{name:<24}{b:>4}{ms:>10.2f}{b / ms * 1e3:>11.0f}")
    for b in batches:
        hf_ms = rows["transformers", b][0]
        print(f"B={b}: kvserve x transformers {hf_ms / rows['kvserve', b][0]:.2f}; tokens "
              f"{agreement(rows['kvserve', b][1], rows['transformers', b][1])}; "
              f"grouped vs fused {agreement(rows['kvserve grouped eager', b][1], rows['kvserve', b][1])}")


if __name__ == "__main__":
    main()
