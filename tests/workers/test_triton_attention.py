"""The Triton paged-attention kernel against a plain softmax reference, on the CPU under
Triton's interpreter (on a GPU when there is one): decode, prefill chunks after cached
context, mixed steps, GQA, shuffled blocks, block tables of different lengths."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU: Triton's interpreter, set before the kernel compiles
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is in the test extra")

from kvserve.kvcache.device_cache import DeviceKVCache  # noqa: E402
from kvserve.workers.model.attention import AttentionMetadata  # noqa: E402
from kvserve.workers.model.attention_triton import TritonAttention, build_tiles  # noqa: E402
from kvserve.workers.model.triton_paged_attention import paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _reference(q, kc, vc, tables, ctxs, qlens, bs):
    hq, d = q.shape[1], q.shape[2]
    hkv = kc.shape[2]
    out = torch.empty_like(q, dtype=torch.float64)
    row = 0
    for table, ctx, n in zip(tables, ctxs, qlens, strict=True):
        seq = ctx + n
        idx = torch.tensor([table[i // bs] * bs + i % bs for i in range(seq)])
        ks = kc.reshape(-1, hkv, d)[idx].double().repeat_interleave(hq // hkv, 1)
        vs = vc.reshape(-1, hkv, d)[idx].double().repeat_interleave(hq // hkv, 1)
        for t in range(n):
            pos = ctx + t
            s = torch.einsum("hd,khd->hk", q[row].double(), ks[: pos + 1]) * d**-0.5
            out[row] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), vs[: pos + 1])
            row += 1
    return out


def _run(streams, hq=4, hkv=4, d=16, bs=4, dtype=torch.float32, seed=0, splits=None):
    """streams: (cached context, new tokens) per stream; blocks are handed out shuffled."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in streams]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=g).tolist()
    tables, at = [], 0
    for k in need:
        tables.append(perm[at : at + k])
        at += k
    cache = DeviceKVCache(1, nb, bs, hkv, d, dtype, DEVICE)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(dtype))
    ctxs = [c for c, _ in streams]
    qlens = [n for _, n in streams]
    t = sum(qlens)
    slots = [tables[i][p // bs] * bs + p % bs for i, (c, n) in enumerate(streams) for p in range(c, c + n)]
    meta = AttentionMetadata(qlens, ctxs, tables, torch.tensor(slots, device=DEVICE), bs)
    q = torch.randn(t, hq, d, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(t, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(t, hkv, d, generator=g).to(dtype).to(DEVICE)
    attn = TritonAttention()
    attn.prepare(meta, torch.device(DEVICE))
    if splits is None:
        out = attn.forward(0, q, k, v, cache, meta)
    else:  # decode tiles with the keys split `splits` ways
        cache.write(0, meta.slot_mapping, k, v)
        p = meta.prepared
        out = paged_attention(q, *cache.layer(0), p.tables, p.tiles, p.block_q, splits=splits)
    kc, vc = cache.layer(0)
    want = _reference(q.cpu(), kc.cpu(), vc.cpu(), tables, ctxs, qlens, bs)
    return out.cpu().double(), want


CASES = {
    "decode": dict(streams=[(5, 1), (1, 1), (12, 1), (30, 1)]),
    "prefill_from_zero": dict(streams=[(0, 9), (0, 1), (0, 20)]),
    "chunk_after_context": dict(streams=[(8, 6), (13, 19)]),
    "mixed": dict(streams=[(7, 1), (0, 17), (9, 5), (22, 1), (3, 2)]),
    "gqa_group3": dict(streams=[(6, 1), (4, 18), (0, 3)], hq=6, hkv=2),
    "gqa_odd_dim_block7": dict(streams=[(10, 1), (0, 11), (15, 4)], hq=8, hkv=2, d=24, bs=7),
    "mqa_long_tables": dict(streams=[(70, 1), (2, 1), (40, 3)], hq=4, hkv=1, bs=4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_softmax_reference(case) -> None:
    got, want = _run(**CASES[case])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("splits", [1, 2, 4, 16])
def test_decode_key_splits_match_reference(splits) -> None:
    """Split-key decode (flash-decoding) merges to the same result: splits longer than a
    stream (empty ones), one key, and streams of several 128-key steps."""
    streams = [(0, 1), (3, 1), (300, 1), (129, 1), (700, 1)]
    got, want = _run(streams=streams, hq=8, hkv=2, d=32, bs=16, splits=splits)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_bfloat16_within_tolerance() -> None:
    got, want = _run(streams=[(5, 1), (0, 12), (9, 4)], hq=4, hkv=2, dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_tiles_cover_every_query_token_once() -> None:
    tiles = build_tiles(np.array([1, 33, 16, 1]), np.array([4, 0, 10, 7]), 16)
    stream, row, n, pos = tiles
    assert stream.tolist() == [0, 1, 1, 1, 2, 3]
    assert row.tolist() == [0, 1, 17, 33, 34, 50]
    assert n.tolist() == [1, 16, 16, 1, 16, 1]
    assert pos.tolist() == [4, 0, 16, 32, 10, 7]


@pytest.mark.slow  # a whole model through the interpreted kernels: ~40 s
def test_engine_with_triton_backend_matches_torch(tmp_path_factory) -> None:
    """The whole engine on the tiny model: chunked prefill (chunks after cached context),
    mixed steps and decode through the kernel give the torch backend's greedy tokens."""
    from tiny_models import tiny_model_path

    from kvserve import LLM, SamplingParams

    path = tiny_model_path(tmp_path_factory)
    prompts = [[100 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate([3, 21, 9, 14])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, attention_backend=backend, block_size=4, kv_cache_tokens=256,
                  max_num_batched_tokens=16, dtype="float32")  # GPU: not bfloat16's rounding
        assert llm.engine.runner.attn.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]
