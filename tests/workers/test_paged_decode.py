"""The C paged-decode kernel against a plain softmax reference, over the head sizes
that take its different paths (AVX2 with D=64/128 unrolled, AVX2 with other D % 8 == 0,
the portable loop otherwise), lengths that end mid-block and mid-vector, sliding windows
that start mid-block (and blocks before the window that hold garbage), and soft-capping."""

from __future__ import annotations

import pytest
import torch
from c_kernels import require_kernel

from kvserve.workers.model.cpu_kernels import load_paged_decode


def _reference(q, k, v, tables, lens, bs, scale, window=0, cap=0.0):
    b, hq, d = q.shape
    hkv = k.shape[2]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(lens[i])
        first = max(0, n - window) if window else 0
        blocks = tables[i, : (n + bs - 1) // bs].long()
        ks = k[blocks].reshape(-1, hkv, d)[first:n].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vs = v[blocks].reshape(-1, hkv, d)[first:n].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        s = (q[i].unsqueeze(1) @ ks.transpose(1, 2)).squeeze(1).double() * scale
        if cap:
            s = torch.tanh(s / cap) * cap
        out[i] = (torch.softmax(s, -1).unsqueeze(1).float() @ vs).squeeze(1)
    return out


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (4, 4, 48), (6, 2, 36)])
@pytest.mark.parametrize("bs", [16, 7])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (12, 0.0), (0, 3.0), (20, 3.0)])
def test_kernel_matches_softmax_reference(hq, hkv, d, bs, window, cap) -> None:
    lib = require_kernel("paged_decode", load_paged_decode())
    g = torch.Generator().manual_seed(hq * d + bs)
    lens = torch.tensor([1, 5, bs, bs + 1, 3 * bs + 5, 97], dtype=torch.int32)
    b = len(lens)
    max_blocks = int((lens.max() + bs - 1) // bs)
    nb = b * max_blocks + 3
    k = torch.randn(nb, bs, hkv, d, generator=g) * 2  # large scores: the softmax max matters
    v = torch.randn(nb, bs, hkv, d, generator=g)
    tables = torch.randperm(nb, generator=g)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    q = torch.randn(b, hq, d, generator=g)
    scale = 0.3 if cap else d**-0.5
    if window:  # what the window leaves out is never read: make it poison
        for i, n in enumerate(lens.tolist()):
            for j in range(max(0, n - window)):
                blk, off = int(tables[i, j // bs]), j % bs
                k[blk, off], v[blk, off] = float("nan"), float("nan")
    out = torch.full_like(q, float("nan"))
    rc = lib.paged_decode_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), tables.contiguous().data_ptr(),
        lens.data_ptr(), b, max_blocks, hq, hkv, d, bs, scale, window, cap, 2,
    )
    assert rc == 0
    want = _reference(q, k, v, tables, lens, bs, scale, window, cap)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def _run(lib, q, k, v, tables, lens, bs, scale, window, cap) -> torch.Tensor:
    b, hq, d = q.shape
    out = torch.full_like(q, float("nan"))
    fn = lib.paged_decode_f16 if k.dtype == torch.float16 else lib.paged_decode_f32
    rc = fn(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), tables.contiguous().data_ptr(),
        lens.data_ptr(), b, tables.shape[1], hq, k.shape[2], d, bs, scale, window, cap, 2,
    )
    assert rc == 0
    return out


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (4, 4, 48), (2, 1, 64)])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (0, 3.0), (12, 0.0)])
def test_prompt_rows_in_tiles_give_each_rows_own_bits(hq, hkv, d, window, cap) -> None:
    """A prompt chunk's rows (one stream's consecutive positions over one block table, as
    the 8-bit path attends them) go through in tiles; every row gives the bits it gives
    alone, and the softmax reference's values. Two streams' chunks and a decode row mixed."""
    lib = require_kernel("paged_decode", load_paged_decode())
    g = torch.Generator().manual_seed(hq + d)
    bs = 16
    nb = 24
    k = torch.randn(nb, bs, hkv, d, generator=g) * 2
    v = torch.randn(nb, bs, hkv, d, generator=g)
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    table_a, table_b = perm[:8], perm[8:16]
    # stream a: positions 56..74 (19 rows: tiles of 8, 8, 3), across the 64-key softmax
    # step of d = 64 (32 keys at d = 128); a decode row of b; b: 1..12
    lens_l = [*range(57, 76), 70, *range(1, 13)]
    tabs = [table_a] * 19 + [table_b] * 13
    tables = torch.stack(tabs)
    lens = torch.tensor(lens_l, dtype=torch.int32)
    q = torch.randn(len(lens_l), hq, d, generator=g)
    scale = 0.3 if cap else d**-0.5
    out = _run(lib, q, k, v, tables, lens, bs, scale, window, cap)
    for i in range(len(lens_l)):
        alone = _run(lib, q[i : i + 1], k, v, tables[i : i + 1], lens[i : i + 1], bs, scale, window, cap)
        assert torch.equal(out[i], alone[0]), i
    want = _reference(q, k, v, tables, lens, bs, scale, window, cap)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("hq,hkv,d", [(16, 4, 64), (8, 2, 128), (4, 4, 48), (4, 2, 40)])
def test_the_256_bit_build_gives_the_same_bits(hq, hkv, d) -> None:
    """On an AVX-512 host the dot products and V sums run 16 lanes wide where D is a multiple
    of 16 (40: 8 lanes in both builds); the 256-bit build (-DKV_NO_W512) gives every row the
    same bits, decode rows and prompt tiles alike (on an AVX2 host both builds are that one)."""
    lib = require_kernel("paged_decode", load_paged_decode())
    narrow = require_kernel("paged_decode", load_paged_decode(("-DKV_NO_W512",)))
    g = torch.Generator().manual_seed(hq * d)
    bs, nb = 16, 39
    k = torch.randn(nb, bs, hkv, d, generator=g) * 2
    v = torch.randn(nb, bs, hkv, d, generator=g)
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    lens_l = [*range(57, 76), 70, 1, 200]  # a prompt chunk's tiles, then decode rows
    tables = torch.stack([perm[:13]] * 20 + [perm[13:26], perm[26:39]])
    lens = torch.tensor(lens_l, dtype=torch.int32)
    q = torch.randn(len(lens_l), hq, d, generator=g)
    for window, cap in ((0, 0.0), (0, 3.0), (12, 0.0)):
        scale = 0.3 if cap else d**-0.5
        out = _run(lib, q, k, v, tables, lens, bs, scale, window, cap)
        assert torch.equal(out, _run(narrow, q, k, v, tables, lens, bs, scale, window, cap))
        want = _reference(q, k, v, tables, lens, bs, scale, window, cap)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("hq,hkv,d,bs", [(16, 4, 64, 16), (8, 2, 128, 32), (9, 3, 64, 7), (4, 4, 48, 16),
                                         (6, 2, 36, 16), (4, 1, 256, 16)])
def test_a_float16_cache_gives_the_bits_of_its_float32_copy(hq, hkv, d, bs) -> None:
    """A float16 KV cache (kv_cache_dtype float16): every row, decode rows and prompt tiles,
    windows and soft-caps, gives the bits the float32 kernel gives over the cache widened to
    float32, on this host's build and the 256-bit one; D 36 takes the portable loop."""
    builds = [require_kernel("paged_decode", load_paged_decode()),
              require_kernel("paged_decode", load_paged_decode(("-DKV_NO_W512",)))]
    g = torch.Generator().manual_seed(hq * d + bs)
    lens_l = [*range(57, 76), 70, 1, 200]  # a prompt chunk's tiles, then decode rows
    width = -(-200 // bs)
    nb = 3 * width
    k = (torch.randn(nb, bs, hkv, d, generator=g) * 2).half()
    v = torch.randn(nb, bs, hkv, d, generator=g).half()
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    tables = torch.stack([perm[:width]] * 20 + [perm[width: 2 * width], perm[2 * width:]])
    lens = torch.tensor(lens_l, dtype=torch.int32)
    q = torch.randn(len(lens_l), hq, d, generator=g)
    for window, cap in ((0, 0.0), (0, 3.0), (12, 0.0)):
        scale = 0.3 if cap else d**-0.5
        for lib in builds:
            want = _run(lib, q, k.float(), v.float(), tables, lens, bs, scale, window, cap)
            assert torch.equal(_run(lib, q, k, v, tables, lens, bs, scale, window, cap), want)


def test_a_float16_cache_whose_blocks_overflow_the_buffers_is_refused() -> None:
    """A float16 span is widened into buffers of 4096 floats: a block of 64 keys of 128 does not
    fit, the kernel refuses it, and the attention backend leaves such a cache to SDPA."""
    from kvserve.workers.model.attention_torch import kernel_reads_kv

    lib = require_kernel("paged_decode", load_paged_decode())
    q = torch.randn(1, 2, 128)
    k = torch.zeros(2, 64, 1, 128, dtype=torch.float16)
    out = torch.empty_like(q)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    rc = lib.paged_decode_f16(q.data_ptr(), k.data_ptr(), k.data_ptr(), out.data_ptr(), tables.data_ptr(),
                              lens.data_ptr(), 1, 1, 2, 1, 128, 64, 0.1, 0, 0.0, 1)
    assert rc == -1
    assert not kernel_reads_kv(torch.float16, 64, 128) and kernel_reads_kv(torch.float16, 32, 128)
    assert kernel_reads_kv(torch.float32, 64, 128) and not kernel_reads_kv(torch.bfloat16, 16, 64)
