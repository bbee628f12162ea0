"""`kvserve bench attention`: CPU attention strategies for one decode step over the paged KV pool.

Every stream has one new token and attends to its own L cached tokens, which sit in a pool laid
out like DeviceKVCache ([layers, 2, blocks, block_size, Hkv, D]) with every stream's blocks at
random places (as a long-running pool ends up). Each strategy computes the step for all layers;
its output is checked against per-stream SDPA (sdpa_gather), and the table gives ms per step,
the effective bandwidth over the KV bytes the step must read, and the ratio to the DRAM roofline.

Strategies:
  sdpa_view    TorchAttention's SDPA path on a pool where each stream's blocks are consecutive:
               one SDPA call per stream and layer over a zero-copy view
  sdpa_gather  the same on the scattered pool: index_select of the stream's blocks, then SDPA
  c_kernel     TorchAttention's default CPU decode path: csrc/paged_decode.c, one call per layer
               for all streams, walking each block table in place (no gather, no padding)
  padded       all streams gathered into [B, Hkv, Lmax, D] plus a length mask, one SDPA per layer
  bucketed     `padded` per group of streams whose block counts round to the same power of two
  chunked      split-KV ("flash-decoding"): every stream's blocks cut into --chunk-tokens chunks,
               all chunks gathered into one SDPA call that also returns each chunk's logsumexp,
               then the chunks of a stream merged by their logsumexp; no padding beyond one chunk
  flex_paged   torch.compile'd flex_attention reading the pool in place: the block tables become a
               BlockMask whose KV block indices are physical block ids
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.bench.common import write_json

if TYPE_CHECKING:  # torch loads lazily so that the CLI's help stays fast
    import torch

    from kvserve.kvcache.device_cache import DeviceKVCache

STRATEGIES = ("sdpa_view", "sdpa_gather", "c_kernel", "padded", "bucketed", "chunked", "flex_paged")
REFERENCE = "sdpa_gather"  # plain torch SDPA per stream: every other strategy is checked against it

Step = Callable[[], "torch.Tensor"]  # one decode step, all layers -> [layers, B, Hq, D]


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser(
        "attention", help="CPU attention strategies for one decode step over the paged KV pool"
    )
    p.add_argument("--batch", type=int, default=32, help="streams per step")
    p.add_argument("--lengths", type=_int_list, default="128,512,1024",
                   help="uniform workloads: every stream has this many tokens (comma list, '' = none)")
    p.add_argument("--mixed", type=_mixed, default="64:2048", metavar="SHORT:LONG",
                   help="also one stream of LONG tokens with batch-1 of SHORT ('' = skip)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=128,
                   help="KV chunk of the 'chunked' strategy (a multiple of --block-size)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list")
    p.add_argument("--flex-eager", action="store_true",
                   help="run flex_attention uncompiled (its unfused reference path; for tests)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per strategy")
    p.add_argument("--dram-gbs", type=float, default=13.0, help="DRAM bandwidth for the roofline")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="write all figures here")
    p.set_defaults(func=cmd_attention)


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError("lengths must be >= 1")
    return vals


def _mixed(text: str) -> tuple[int, int] | None:
    if not text:
        return None
    vals = _int_list(text.replace(":", ","))
    if len(vals) != 2:
        raise argparse.ArgumentTypeError(f"expected SHORT:LONG, got {text!r}")
    return vals[0], vals[1]


# ---- workload ------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    lengths: list[int]  # tokens per stream, the new one included
    cache: DeviceKVCache  # scattered pool
    tables: list[list[int]]  # block ids per stream, exactly cdiv(L, block_size) each
    q: torch.Tensor  # [layers, B, Hkv, rep, D]: query heads sharing a KV head are adjacent

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one step must read at least: every stream's own tokens, all layers."""
        c = self.cache
        per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * c.kv.element_size()
        return sum(self.lengths) * per_token


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gather(src: torch.Tensor, ids: torch.Tensor, bufs: dict[Any, torch.Tensor], key: Any) -> torch.Tensor:
    """index_select of blocks into a buffer kept across layers and steps: a fresh multi-MB tensor
    per layer would be mmap'ed and page-faulted anew each time, timing the allocator."""
    import torch

    shape = (ids.numel(), *src.shape[1:])
    buf = bufs.get(key)
    if buf is None or buf.shape != shape:
        buf = bufs[key] = torch.empty(shape, dtype=src.dtype, device=src.device)
    return torch.index_select(src, 0, ids, out=buf)


def build_workload(name: str, lengths: list[int], args: argparse.Namespace, seed: int) -> Workload:
    import torch

    from kvserve.kvcache.device_cache import DeviceKVCache

    bs = args.block_size
    nblk = [_cdiv(n, bs) for n in lengths]
    g = torch.Generator().manual_seed(seed)
    cache = DeviceKVCache(args.layers, sum(nblk), bs, args.kv_heads, args.head_dim,
                          torch.float32, "cpu")
    cache.kv.normal_(generator=g)
    perm = torch.randperm(sum(nblk), generator=g).tolist()
    tables, i = [], 0
    for n in nblk:
        tables.append(perm[i : i + n])
        i += n
    rep = args.q_heads // args.kv_heads
    q = torch.randn(args.layers, len(lengths), args.kv_heads, rep, args.head_dim, generator=g)
    return Workload(name, lengths, cache, tables, q)


def contiguous_copy(w: Workload) -> tuple[DeviceKVCache, list[list[int]]]:
    """The same KV rearranged so that each stream's blocks are consecutive, stream after stream."""
    import torch

    from kvserve.kvcache.device_cache import DeviceKVCache

    c = w.cache
    order = torch.tensor([b for t in w.tables for b in t])
    out = DeviceKVCache(c.num_layers, c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim,
                        c.kv.dtype, c.kv.device)
    torch.index_select(c.kv, 2, order, out=out.kv)
    tables, i = [], 0
    for t in w.tables:
        tables.append(list(range(i, i + len(t))))
        i += len(t)
    return out, tables


# ---- strategies ----------------------------------------------------------------------------
def backend_step(w: Workload, cache: DeviceKVCache, tables: list[list[int]], use_kernel: bool) -> Step:
    """The production backend, fed as the model runner feeds it (prepare once, forward per layer);
    `use_kernel` picks its C decode kernel, else its per-stream SDPA path."""
    import torch

    from kvserve.workers.model.attention import AttentionMetadata
    from kvserve.workers.model.attention_torch import TorchAttention

    backend = TorchAttention(use_kernel=use_kernel)
    if use_kernel and backend.kernel is None:
        # the backend would silently fall back to SDPA: that is not this row's strategy
        raise RuntimeError("the C decode kernel is unavailable (no compiler, or KVSERVE_NO_C_KERNELS)")
    bs, c = w.block_size, cache
    b, hq = len(w.lengths), w.q.shape[2] * w.q.shape[3]
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, w.lengths, strict=True)])

    def step() -> torch.Tensor:
        meta = AttentionMetadata([1] * b, [n - 1 for n in w.lengths], tables, slots, bs)
        backend.prepare(meta, c.kv.device)
        out = torch.empty(c.num_layers, b, hq, c.head_dim)
        for layer in range(c.num_layers):
            # the new tokens' K/V are the values already in their slots, so the backend's
            # cache write leaves the pool unchanged from step to step
            kc, vc = c.layer(layer)
            k = kc.view(-1, c.num_kv_heads, c.head_dim)[slots]
            v = vc.view(-1, c.num_kv_heads, c.head_dim)[slots]
            out[layer] = backend.forward(layer, w.q[layer].reshape(b, hq, c.head_dim), k, v, c, meta)
        return out

    return step


def padded_step(w: Workload, groups: list[list[int]]) -> Step:
    """One SDPA per group and layer over the group's streams gathered into [n, Hkv, Lmax, D]."""
    import torch
    import torch.nn.functional as F

    c, bs = w.cache, w.block_size
    h, d = c.num_kv_heads, c.head_dim
    hq = w.q.shape[2] * w.q.shape[3]
    whole = len(groups) == 1
    bufs: dict[Any, torch.Tensor] = {}

    def step() -> torch.Tensor:
        plans = []
        for rows in groups:
            lens = [w.lengths[r] for r in rows]
            nmax = max(_cdiv(n, bs) for n in lens)
            # pad short tables with their own first block: read but masked out
            ids = [w.tables[r] + [w.tables[r][0]] * (nmax - len(w.tables[r])) for r in rows]
            mask = None
            if any(n != nmax * bs for n in lens):
                pos = torch.arange(nmax * bs)
                keep = pos.unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
                mask = torch.zeros(len(rows), 1, 1, nmax * bs).masked_fill_(
                    ~keep.view(len(rows), 1, 1, -1), float("-inf"))
            plans.append((torch.tensor(rows), torch.tensor(ids).view(-1), nmax * bs, mask))
        out = torch.empty(c.num_layers, len(w.lengths), hq, d)
        for layer in range(c.num_layers):
            kc, vc = c.layer(layer)
            for g, (rows, ids, lpad, mask) in enumerate(plans):
                n = rows.numel()
                ks = _gather(kc, ids, bufs, ("k", g)).view(n, lpad, h, d).transpose(1, 2)
                vs = _gather(vc, ids, bufs, ("v", g)).view(n, lpad, h, d).transpose(1, 2)
                qs = w.q[layer] if whole else w.q[layer].index_select(0, rows)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
                out[layer].index_copy_(0, rows, o.view(n, hq, d))
        return out

    return step


def bucket_groups(w: Workload) -> list[list[int]]:
    """Streams grouped by block count rounded up to a power of two: padding < 2x per stream."""
    buckets: dict[int, list[int]] = {}
    for i, t in enumerate(w.tables):
        buckets.setdefault(1 << (len(t) - 1).bit_length(), []).append(i)
    return list(buckets.values())


def chunked_step(w: Workload, chunk_tokens: int) -> Step:
    """Split-KV decode: one SDPA call per layer over all streams' chunks, merged by logsumexp."""
    import torch

    c, bs = w.cache, w.block_size
    cb = chunk_tokens // bs
    h, d = c.num_kv_heads, c.head_dim
    b, rep = len(w.lengths), w.q.shape[3]
    # the fused CPU flash kernel; unlike the public SDPA it also returns the logsumexp per row
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bufs: dict[Any, torch.Tensor] = {}

    def step() -> torch.Tensor:
        ids: list[int] = []
        seg: list[int] = []
        valid: list[int] = []
        for s, (t, n) in enumerate(zip(w.tables, w.lengths, strict=True)):
            for j in range(0, len(t), cb):
                part = t[j : j + cb]
                ids += part + [part[0]] * (cb - len(part))
                seg.append(s)
                valid.append(min(chunk_tokens, n - j * bs))
        nc = len(seg)
        idx, segt = torch.tensor(ids), torch.tensor(seg)
        mask = None
        if any(v != chunk_tokens for v in valid):
            keep = torch.arange(chunk_tokens).unsqueeze(0) < torch.tensor(valid).unsqueeze(1)
            # the kernel takes an additive mask of the query's dtype
            mask = torch.zeros(nc, 1, 1, chunk_tokens).masked_fill_(
                ~keep.view(nc, 1, 1, -1), float("-inf"))
        single = nc == b  # one chunk per stream: nothing to merge
        segx = segt.view(nc, 1, 1).expand(nc, h, rep)
        out = torch.empty(c.num_layers, b, h * rep, d)
        for layer in range(c.num_layers):
            kc, vc = c.layer(layer)
            ks = _gather(kc, idx, bufs, "k").view(nc, chunk_tokens, h, d).transpose(1, 2)
            vs = _gather(vc, idx, bufs, "v").view(nc, chunk_tokens, h, d).transpose(1, 2)
            qs = w.q[layer] if single else w.q[layer].index_select(0, segt)
            o, lse = flash(qs, ks, vs, attn_mask=mask)  # [nc, h, rep, d], [nc, h, rep]
            if single:
                out[layer] = o.view(b, h * rep, d)
                continue
            m = torch.full((b, h, rep), float("-inf")).scatter_reduce_(0, segx, lse, "amax")
            wgt = torch.exp(lse - m.index_select(0, segt))
            den = torch.zeros(b, h, rep).index_add_(0, segt, wgt)
            num = torch.zeros(b, h, rep, d).index_add_(0, segt, o * wgt.unsqueeze(-1))
            out[layer] = (num / den.unsqueeze(-1)).view(b, h * rep, d)
        return out

    return step


def flex_step(w: Workload, compiled: bool) -> Step:
    """flex_attention over the whole pool as one KV sequence; the BlockMask names each stream's
    physical blocks, so only those are read and nothing is gathered."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    c, bs = w.cache, w.block_size
    h, d = c.num_kv_heads, c.head_dim
    b, hq = len(w.lengths), w.q.shape[2] * w.q.shape[3]
    pool_tokens = c.num_blocks * bs
    # persistent buffers read by mask_mod, refilled in place each step so that the compiled
    # kernel is reused rather than retraced for a new closure
    owner = torch.full((c.num_blocks,), -1, dtype=torch.int64)  # stream of each physical block
    last = torch.zeros(b, dtype=torch.int64)
    tail = torch.zeros(b, dtype=torch.int64)

    def mask_mod(bi: torch.Tensor, hi: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        # complete on its own (flex's contract; the eager path applies only this), though the
        # compiled kernel evaluates it only on the partial blocks: each stream's last one
        blk = kv // bs
        return (owner[blk] == bi) & ((blk != last[bi]) | (kv % bs < tail[bi]))

    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def step() -> torch.Tensor:
        nblk = [len(t) for t in w.tables]
        # the CPU kernel wants index rows as wide as the KV length in blocks: the whole pool
        full = torch.zeros(b, 1, 1, c.num_blocks, dtype=torch.int32)
        part = torch.zeros(b, 1, 1, c.num_blocks, dtype=torch.int32)
        for s, t in enumerate(w.tables):
            full[s, 0, 0, : len(t) - 1] = torch.tensor(t[:-1], dtype=torch.int32)
        owner.fill_(-1).index_put_((torch.tensor([x for t in w.tables for x in t]),),
                                   torch.tensor([s for s, t in enumerate(w.tables) for _ in t]))
        last.copy_(torch.tensor([t[-1] for t in w.tables]))
        tail.copy_(torch.tensor([n - (len(t) - 1) * bs for t, n in zip(w.tables, w.lengths, strict=True)]))
        part[:, 0, 0, 0] = last.to(torch.int32)
        mask = BlockMask.from_kv_blocks(
            torch.ones(b, 1, 1, dtype=torch.int32),  # the last block, where mask_mod applies
            part,
            torch.tensor([n - 1 for n in nblk], dtype=torch.int32).view(b, 1, 1),  # all others
            full,
            BLOCK_SIZE=(1, bs),
            mask_mod=mask_mod,
            seq_lengths=(1, pool_tokens),
            compute_q_blocks=False,  # inference only: no backward
        )
        out = torch.empty(c.num_layers, b, hq, d)
        for layer in range(c.num_layers):
            kc, vc = c.layer(layer)
            ks = kc.view(1, pool_tokens, h, d).transpose(1, 2).expand(b, h, pool_tokens, d)
            vs = vc.view(1, pool_tokens, h, d).transpose(1, 2).expand(b, h, pool_tokens, d)
            o = attend(w.q[layer].view(b, hq, 1, d), ks, vs, block_mask=mask, enable_gqa=True)
            out[layer] = o.view(b, hq, d)
        return out

    return step


# ---- measurement ---------------------------------------------------------------------------
def measure_read_gbs(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """This machine's streaming read bandwidth as torch sees it: the best of a few sums over an
    array far larger than the caches (the best, because other load only ever lowers it)."""
    import torch

    x = torch.ones(nbytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def run_workload(w: Workload, args: argparse.Namespace, names: list[str],
                 read_gbs: float) -> dict[str, Any]:
    steps: dict[str, Step] = {}
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name in names:
        try:
            if name == "sdpa_view":
                cache, tables = contiguous_copy(w)
                fn = backend_step(w, cache, tables, use_kernel=False)
            elif name == "sdpa_gather":
                fn = backend_step(w, w.cache, w.tables, use_kernel=False)
            elif name == "c_kernel":
                fn = backend_step(w, w.cache, w.tables, use_kernel=True)
            elif name == "padded":
                fn = padded_step(w, [list(range(len(w.lengths)))])
            elif name == "bucketed":
                fn = padded_step(w, bucket_groups(w))
            elif name == "chunked":
                fn = chunked_step(w, args.chunk_tokens)
            else:
                fn = flex_step(w, compiled=not args.flex_eager)
            t = time.perf_counter()
            outputs[name] = fn()  # warm-up; for flex_paged also the compile
            results[name] = {"first_step_s": time.perf_counter() - t, "samples_ms": []}
            steps[name] = fn
        except Exception as e:  # a strategy that cannot run here is a finding, not a crash
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"  {name}: {results[name]['error']}", file=sys.stderr)
    # round-robin, so that load from other processes spreads over all strategies alike
    for _ in range(args.repeats):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            results[name]["samples_ms"].append((time.perf_counter() - t) * 1e3)
    ref = outputs.get(REFERENCE, next(iter(outputs.values()), None))
    roofline_ms = w.kv_bytes / (args.dram_gbs * 1e9) * 1e3
    for name in steps:
        r, s = results[name], results[name]["samples_ms"]
        med = statistics.median(s)
        r.update(ms_median=med, ms_min=min(s), ms_max=max(s), gbs=w.kv_bytes / med / 1e6,
                 x_roofline=med / roofline_ms,
                 max_abs_diff=float((outputs[name] - ref).abs().max()) if ref is not None else None)
    return {"name": w.name, "streams": len(w.lengths), "tokens": sum(w.lengths),
            "max_len": max(w.lengths), "kv_bytes": w.kv_bytes, "roofline_ms": roofline_ms,
            "roofline_measured_ms": w.kv_bytes / (read_gbs * 1e9) * 1e3, "results": results}


def print_workload(r: dict[str, Any], dram_gbs: float) -> None:
    print(f"\n{r['name']}: {r['streams']} streams, {r['tokens']} tokens, "
          f"KV read {r['kv_bytes'] / 1e6:.0f} MB/step, roofline {r['roofline_ms']:.1f} ms "
          f"@ {dram_gbs:g} GB/s ({r['roofline_measured_ms']:.1f} ms at the measured read bandwidth)")
    print(f"{'strategy':<12} {'ms/step':>9} {'min-max':>15} {'GB/s':>6} {'x roofline':>10} "
          f"{'max|diff|':>9}")
    for name, x in r["results"].items():
        if "error" in x:
            print(f"{name:<12} failed: {x['error']}")
            continue
        extra = f"  (first step incl. compile {x['first_step_s']:.1f} s)" if name == "flex_paged" else ""
        print(f"{name:<12} {x['ms_median']:9.1f} {x['ms_min']:7.1f}-{x['ms_max']:<7.1f} "
              f"{x['gbs']:6.1f} {x['x_roofline']:10.2f} {x['max_abs_diff']:9.1e}{extra}")


def cmd_attention(args: argparse.Namespace) -> int:
    import torch

    from kvserve.bench.common import available_cores, machine_info

    names = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(names) - set(STRATEGIES))
    problems = [f"unknown strategies {unknown}; choose from {list(STRATEGIES)}"] if unknown else []
    if args.q_heads % args.kv_heads:
        problems.append("--q-heads must be a multiple of --kv-heads")
    if args.chunk_tokens % args.block_size:
        problems.append("--chunk-tokens must be a multiple of --block-size")
    if args.batch < 1 or args.layers < 1 or args.repeats < 1:
        problems.append("--batch, --layers and --repeats must be >= 1")
    for msg in problems:
        print(f"kvserve: error: {msg}", file=sys.stderr)
    if problems:
        return 2
    threads = args.threads or available_cores()
    torch.set_num_threads(threads)
    specs = [(f"uniform {n}", [n] * args.batch) for n in args.lengths]
    if args.mixed:
        short, long_ = args.mixed
        specs.append((f"mixed 1x{long_} + {args.batch - 1}x{short}", [long_] + [short] * (args.batch - 1)))
    report: dict[str, Any] = {
        "machine": machine_info(threads) | {"read_gbs_measured": measure_read_gbs()},
        "geometry": {k: getattr(args, k) for k in ("batch", "layers", "q_heads", "kv_heads",
                                                   "head_dim", "block_size", "chunk_tokens")}
        | {"dtype": "float32", "dram_gbs": args.dram_gbs, "repeats": args.repeats},
        "workloads": [],
    }
    m = report["machine"]
    print(f"{m['cpu']}, {threads} threads, torch {m['torch']}; "
          f"measured read bandwidth {m['read_gbs_measured']:.1f} GB/s")
    for i, (name, lengths) in enumerate(specs):
        w = build_workload(name, lengths, args, args.seed + i)
        r = run_workload(w, args, names, m["read_gbs_measured"])
        del w  # one pool at a time: the long workloads take GBs
        report["workloads"].append(r)
        print_workload(r, args.dram_gbs)
    write_json(args.json, report)
    return 0
