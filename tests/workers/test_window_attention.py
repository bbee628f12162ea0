"""Per-layer attention settings (sliding window, score soft-cap, q scale) in every paged
attention path against a float64 softmax reference: the torch backend with the C decode
kernel and with SDPA only, and the Triton kernel (under its interpreter on the CPU), for
a mixed step of decode tokens and prefill chunks after cached context, shuffled blocks,
windows that start mid-block, and KV the window no longer reaches poisoned with NaN."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU: Triton's interpreter, set before the kernel compiles
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from c_kernels import require_kernel  # noqa: E402

from kvserve.kvcache.device_cache import DeviceKVCache  # noqa: E402
from kvserve.workers.model.attention import AttentionMetadata, LayerAttention  # noqa: E402
from kvserve.workers.model.attention_torch import TorchAttention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
STREAMS = [(30, 1), (5, 1), (20, 9), (0, 25), (40, 1), (13, 3)]  # (cached context, new tokens)
LAYERS = [
    LayerAttention(0.37, window=7, softcap=1.5),  # Gemma 2's sliding layer
    LayerAttention(0.37, softcap=1.5),  # ... and its global one
    LayerAttention(16**-0.5, window=10),  # Mistral / Gemma 3 sliding layer
    LayerAttention(0.2),  # a plain layer with another q scale
]


def _reference(q, kc, vc, tables, spec: LayerAttention, bs: int) -> torch.Tensor:
    hq, d = q.shape[1], q.shape[2]
    hkv = kc.shape[2]
    out = torch.empty_like(q, dtype=torch.float64)
    row = 0
    for table, (ctx, n) in zip(tables, STREAMS, strict=True):
        idx = torch.tensor([table[i // bs] * bs + i % bs for i in range(ctx + n)])
        ks = kc.reshape(-1, hkv, d)[idx].double().repeat_interleave(hq // hkv, 1)
        vs = vc.reshape(-1, hkv, d)[idx].double().repeat_interleave(hq // hkv, 1)
        for t in range(n):
            pos = ctx + t
            first = 0 if spec.window is None else max(0, pos - spec.window + 1)
            s = torch.einsum("hd,khd->hk", q[row].double(), ks[first : pos + 1]) * spec.scale
            if spec.softcap is not None:
                s = torch.tanh(s / spec.softcap) * spec.softcap
            out[row] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), vs[first : pos + 1])
            row += 1
    return out


def _step(bs: int = 4, hq: int = 6, hkv: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(3)
    need = [-(-(c + n) // bs) for c, n in STREAMS]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g).tolist()
    tables, at = [], 0
    for k in need:
        tables.append(perm[at : at + k])
        at += k
    cache = DeviceKVCache(len(LAYERS), nb, bs, hkv, d, torch.float32, DEVICE)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g) * 2)
    t = sum(n for _, n in STREAMS)
    slots = [tables[i][p // bs] * bs + p % bs for i, (c, n) in enumerate(STREAMS) for p in range(c, c + n)]
    meta = AttentionMetadata([n for _, n in STREAMS], [c for c, _ in STREAMS], tables,
                             torch.tensor(slots, device=DEVICE), bs)
    qkv = [torch.randn(t, h, d, generator=g).to(DEVICE) for h in (hq, hkv, hkv)]
    return cache, meta, tables, qkv


def _poison_outside_windows(cache, tables, bs: int) -> None:
    """NaN in every block of a windowed layer before the block of the first key the step's
    queries see: those blocks must not be read at all."""
    for layer, spec in enumerate(LAYERS):
        if spec.window is None:
            continue
        kc, vc = cache.layer(layer)
        for table, (ctx, _) in zip(tables, STREAMS, strict=True):
            for b in range(max(0, ctx - spec.window + 1) // bs):
                kc[table[b]] = float("nan")
                vc[table[b]] = float("nan")


def _check(attn, bs: int = 4) -> None:
    cache, meta, tables, (q, k, v) = _step(bs)
    _poison_outside_windows(cache, tables, bs)
    attn.configure(LAYERS)
    attn.prepare(meta, torch.device(DEVICE))
    for layer, spec in enumerate(LAYERS):
        out = attn.forward(layer, q, k, v, cache, meta)
        kc, vc = cache.layer(layer)
        want = _reference(q.cpu(), kc.cpu(), vc.cpu(), tables, spec, bs)
        torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=1e-4, msg=str(spec))


@pytest.mark.parametrize("kernel", [True, False], ids=["c-decode-kernel", "sdpa-only"])
@pytest.mark.parametrize("bs", [4, 16])
def test_torch_backend(kernel: bool, bs: int) -> None:
    if DEVICE != "cpu":
        pytest.skip("the CPU backend's paths")
    attn = TorchAttention(use_kernel=kernel)
    if kernel:
        from kvserve.workers.model.cpu_kernels import load_paged_decode

        require_kernel("paged_decode", load_paged_decode())
    _check(attn, bs)


def test_triton_backend() -> None:
    pytest.importorskip("triton", reason="triton is in the test extra")
    from kvserve.workers.model.attention_triton import TritonAttention

    _check(TritonAttention(), 4)


def test_triton_decode_splits_with_window() -> None:
    """Split-key decode starts its splits at the window: long streams, a window of 100."""
    pytest.importorskip("triton", reason="triton is in the test extra")
    from kvserve.workers.model.triton_paged_attention import paged_attention

    g = torch.Generator().manual_seed(9)
    lens, bs, hq, hkv, d, window = [300, 5, 129, 100], 16, 4, 2, 32, 100
    need = [-(-n // bs) for n in lens]
    nb = sum(need)
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int64)
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[at : at + k]
        at += k
    kc = torch.randn(nb, bs, hkv, d, generator=g)
    vc = torch.randn(nb, bs, hkv, d, generator=g)
    q = torch.randn(len(lens), hq, d, generator=g)
    tiles = torch.tensor([list(range(len(lens))), list(range(len(lens))), [1] * len(lens),
                          [n - 1 for n in lens]])
    out = paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables.to(DEVICE),
                          tiles.to(DEVICE), 1, splits=4, scale=0.3, window=window)
    for i, n in enumerate(lens):
        idx = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for p in range(max(0, n - window), n)])
        ks = kc.reshape(-1, hkv, d)[idx].double().repeat_interleave(hq // hkv, 1)
        vs = vc.reshape(-1, hkv, d)[idx].double().repeat_interleave(hq // hkv, 1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[i].double(), ks) * 0.3, -1)
        want = torch.einsum("hk,khd->hd", p, vs)
        torch.testing.assert_close(out[i].cpu().double(), want, atol=2e-5, rtol=1e-4)
