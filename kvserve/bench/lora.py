"""`kvserve bench lora`: the cost of LoRA adapters mixed in one batch, and of bringing one back.

Throughput: the same B streams (a random prompt each, greedy, a fixed number of output
tokens) through one engine, first all on the base model, then spread round-robin over K
synthetic adapters (rank --rank on every adapted module: q, k, v, o, gate, up, down) for
each K of --adapters, all K in device slots so every step mixes them. Overhead is the
drop in generated tokens against the base run, per wall second and per CPU second of the
process (on one thread the latter holds on a machine shared with other load).

Swap time: one adapter brought into a device slot from the host-memory cache (a copy of
its tensors) against loaded from disk (files read, parsed, checked and laid out; the files
are in the OS page cache after the first read, so this is the floor of a disk load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from kvserve.bench.common import Timer, machine_info, random_prompts, write_json

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("lora", help="LoRA adapters mixed in a batch: throughput and swap time")
    p.add_argument("--model", default=None)
    p.add_argument("--adapters", default="1,4,16", help="adapter counts mixed in the batch")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--streams", type=int, default=16, help="streams batched together")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    p.add_argument("--swaps", type=int, default=5, help="timed swaps of each kind")
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds over every configuration, interleaved; each configuration's "
                        "best round is reported (other load on the machine only slows a round)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=cmd_lora)


def write_adapter(path: str, cfg: Any, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter of `rank` on every adapted module of `cfg`'s model."""
    import torch
    from safetensors.torch import save_file

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for m in MODULES:
            if m in ("gate_proj", "up_proj", "down_proj") and cfg.is_moe_layer(i):
                continue
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fan_in, fan_out = shapes[m]
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                   "target_modules": MODULES, "bias": "none"}, f)
    return path


def _throughput(llm: Any, prompts: list[list[int]], tokens: int,
                names: list[str | None]) -> tuple[float, float, float]:
    """(generated tokens per wall second, per CPU second of this process, CPU seconds per
    wall second) of the prompts spread round-robin over `names`, after a warm-up that loads
    their slots. On one thread, tokens per CPU second does not depend on how much of a core
    other load left the run."""
    from kvserve import SamplingParams

    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    loras = [names[i % len(names)] for i in range(len(prompts))]
    warm = min(len(prompts), len(names))
    llm.generate(prompts[:warm], SamplingParams(max_tokens=2), lora=loras[:warm])
    with Timer() as t:
        outs = llm.generate(prompts, sp, lora=loras)
    n = sum(len(o.token_ids) for o in outs)
    return n / t.elapsed, n / t.cpu, t.cpu / t.elapsed


def cmd_lora(a: argparse.Namespace) -> int:
    import torch

    from kvserve import LLM

    counts = [int(x) for x in a.adapters.split(",") if x.strip()]
    top = max(counts + [1])
    threads = a.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-lora-") as tmp:
        llm = LLM(a.model, device=a.device, num_threads=a.threads, enable_lora=True,
                  max_loras=top, max_lora_rank=a.rank, max_cpu_loras=top + 1,
                  max_num_seqs=max(a.streams, 16), host_cache_gib=0,
                  kv_cache_tokens=max(4096, 2 * a.streams * (a.prompt_len + a.tokens)))
        eng = llm.engine
        cfg = eng.model_config
        paths = [write_adapter(os.path.join(tmp, f"a{i}"), cfg, a.rank, i) for i in range(top + 1)]
        for i in range(top):
            llm.load_lora(f"a{i}", paths[i])
        prompts = random_prompts(a.streams, a.prompt_len, cfg.vocab_size, seed=0)
        configs = [0, *counts]
        rounds: dict[int, list[tuple[float, float, float]]] = {k: [] for k in configs}
        for _ in range(max(1, a.repeat)):
            for k in configs:
                names = [None] if k == 0 else [f"a{i}" for i in range(k)]
                rounds[k].append(_throughput(llm, prompts, a.tokens, names))
        rows = []
        for k in configs:
            rs = rounds[k]
            rows.append({"adapters": k, "tokens_per_s": max(r[0] for r in rs),
                         "tokens_per_cpu_s": max(r[1] for r in rs),
                         "cpu_per_wall": max(r[2] for r in rs),
                         "rounds_tokens_per_s": [r[0] for r in rs],
                         "rounds_tokens_per_cpu_s": [r[1] for r in rs]})
        base, base_cpu = rows[0]["tokens_per_s"], rows[0]["tokens_per_cpu_s"]
        for r in rows[1:]:
            r["overhead_pct"] = 100.0 * (base / r["tokens_per_s"] - 1.0)
            r["overhead_cpu_pct"] = 100.0 * (base_cpu / r["tokens_per_cpu_s"] - 1.0)
        swaps = _swaps(eng, paths[top], a.swaps)
    report = {"bench": "lora", "model": str(eng.model_path), "device": str(eng.runner.device),
              "rank": a.rank, "streams": a.streams, "prompt_len": a.prompt_len,
              "tokens": a.tokens, "throughput": rows, "swap": swaps,
              "slot_bytes": eng.runner.lora.nbytes if eng.runner.lora else 0,
              "adapter_bytes": eng.adapters.resolve("a0").nbytes if eng.adapters else 0,
              "machine": machine_info(threads),
              "date": time.strftime("%Y-%m-%d")}
    print(f"LoRA bench: {report['model']} on {report['device']}, {a.streams} streams, "
          f"prompt {a.prompt_len}, {a.tokens} tokens each, rank {a.rank} on "
          f"q/k/v/o/gate/up/down")
    print(f"{'adapters':>8} {'tok/s':>9} {'overhead':>9} {'tok/cpu-s':>10} {'overhead':>9} "
          f"{'cpu/wall':>9}   (best of {a.repeat})")
    for r in rows:
        over = f"{r['overhead_pct']:+.1f}%" if "overhead_pct" in r else "-"
        over_cpu = f"{r['overhead_cpu_pct']:+.1f}%" if "overhead_cpu_pct" in r else "-"
        print(f"{r['adapters']:>8} {r['tokens_per_s']:>9.1f} {over:>9} "
              f"{r['tokens_per_cpu_s']:>10.1f} {over_cpu:>9} {r['cpu_per_wall']:>9.2f}")
    print(f"adapter swap into a device slot ({report['adapter_bytes'] / 2**20:.1f} MiB): "
          f"from host memory {swaps['host_ms']:.2f} ms, from disk {swaps['disk_ms']:.2f} ms "
          f"(fastest of {a.swaps}; medians {swaps['host_median_ms']:.2f} and "
          f"{swaps['disk_median_ms']:.2f} ms)")
    write_json(a.json, report)
    return 0


def _swaps(eng: Any, path: str, n: int) -> dict[str, float]:
    """Fastest and median ms of a slot load from the host copy, and of a load from disk
    (read, checked, laid out) followed by the same copy. Runs last: it overwrites slot 0."""
    import torch

    slots = eng.runner.lora
    mgr = eng.adapters
    sync = torch.cuda.synchronize if slots.device.type == "cuda" else (lambda: None)
    weights = mgr.read(path)
    host, disk = [], []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        slots.load(0, weights)
        sync()
        host.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        w = mgr.read(path)
        slots.load(0, w)
        sync()
        disk.append(time.perf_counter() - t0)
    return {"host_ms": 1e3 * min(host), "disk_ms": 1e3 * min(disk),
            "host_median_ms": 1e3 * statistics.median(host),
            "disk_median_ms": 1e3 * statistics.median(disk)}
