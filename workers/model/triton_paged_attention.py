"""Triton kernel: paged attention for a whole mixed step in one launch per layer.

The step's query tokens are cut into tiles; a tile is up to BLOCK_Q consecutive query
tokens of one stream (a decode token is a tile of one). One program handles one tile
and one KV head: its rows are the tile's tokens times the query heads that share that
KV head (GQA), so K/V are read once for the whole group. The program walks the stream's
keys through its block table (any block order, any block size), causal to each row's
position, with an online softmax. Prefill chunks after cached context, plain prefill
and decode tokens all take the same path. A sliding-window layer starts the walk at the
tile's first reachable key and masks per row; a soft-capped layer (Gemma 2) passes the
scores through cap * tanh(s / cap) before the mask.

Decode at small batch has too few (tile, KV head) programs to fill the GPU, so the keys
are also split across programs (flash-decoding): each split writes its unnormalized
output and softmax statistics to a float32 scratch, and a second small kernel merges
them. The split count depends only on the tile count, so a CUDA graph captured for a
batch bucket keeps it.

Runs on CUDA, and on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
before this module is imported), which is how CI checks it without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# Inputs that change from step to step (views into the step's one pinned buffer start at any
# offset; token counts vary) are not specialized on, so a new batch never recompiles.
_VARYING = ["tables_ptr", "table_stride", "tile_stream_ptr", "tile_row_ptr", "tile_len_ptr",
            "tile_pos_ptr", "part_ptr", "ml_ptr", "n_tokens", "stride_qt", "stride_ot"]


@triton.jit(do_not_specialize=_VARYING)
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # q/o: [T, Hq, D]; k/v: one layer, [num_blocks * BS, Hkv, D]
    tables_ptr, table_stride,  # [S, max_blocks] int32 or int64
    tile_stream_ptr, tile_row_ptr, tile_len_ptr, tile_pos_ptr,  # [num_tiles] each
    part_ptr, ml_ptr, n_tokens, n_heads,  # split scratch: [SPLITS, T, Hq, D_P], [2, SPLITS, T, Hq]
    sm_scale, window, softcap,  # window: keys a row sees, itself included (WINDOWED only)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    ROWS: tl.constexpr,  # max(16, BLOCK_Q * GROUP_P): tl.dot needs 16 rows
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BS: tl.constexpr,  # tokens per KV block
    BLOCK_N: tl.constexpr,  # keys per inner step
    IEEE: tl.constexpr,  # float32 dots without TF32
    UPCAST: tl.constexpr,  # dots in float32 (the interpreter's bfloat16 dot is wrong)
    SPLITS: tl.constexpr,  # programs sharing one tile's keys (1: no scratch, no merge)
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    stream = tl.load(tile_stream_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)  # first query token of the tile in q
    n_q = tl.load(tile_len_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)  # absolute position of that token

    r = tl.arange(0, ROWS)
    qi = r // GROUP_P  # token within the tile
    g = r % GROUP_P  # query head within the group
    row_ok = (qi < n_q) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    q_off = (row0 + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = pos0 + qi  # each row attends keys 0..pos

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P], dtype=tl.float32)
    n_keys = pos0 + n_q
    k_lo = 0
    if WINDOWED:  # the tile's first row sees nothing before this key; later rows even less
        k_lo = tl.maximum(pos0 - window + 1, 0)
    lo = k_lo
    hi = n_keys
    if SPLITS > 1:  # this program's share of the keys, whole BLOCK_N steps
        chunk = tl.cdiv(tl.cdiv(n_keys - k_lo, SPLITS), BLOCK_N) * BLOCK_N
        lo = k_lo + split * chunk
        hi = tl.minimum(n_keys, lo + chunk)
    table = tables_ptr + stream * table_stride
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        blk = tl.load(table + j // BS, mask=j_ok, other=0)
        slot = blk.to(tl.int64) * BS + j % BS
        kv_off = slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        elif IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * sm_scale
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap * tanh(s / softcap)
        seen = (j[None, :] <= pos[:, None]) & j_ok[None, :]
        if WINDOWED:
            seen = seen & (j[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        elif IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLITS > 1:  # unnormalized: the merge kernel weighs the splits by their maxima
        ok = (qi < BLOCK_Q) & (g < GROUP)  # padding tiles too: their statistics are empty
        at = (split * n_tokens + row0 + qi) * n_heads + head
        tl.store(part_ptr + at[:, None] * HEAD_DIM_P + d[None, :], acc, mask=ok[:, None])
        tl.store(ml_ptr + at, m_i, mask=ok)
        tl.store(ml_ptr + SPLITS * n_tokens * n_heads + at, l_i, mask=ok)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # empty (padding) tiles: no 0/0
        o_off = (row0 + qi)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["n_tokens"])
def _merge_splits_kernel(
    part_ptr, ml_ptr, o_ptr, n_tokens, n_heads, stride_ot, stride_oh,
    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM_P)
    m = tl.full([1], -1.0e30, dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(ml_ptr + (s * n_tokens + t) * n_heads + h + tl.zeros([1], tl.int32)))
    acc = tl.zeros([HEAD_DIM_P], dtype=tl.float32)
    denom = tl.zeros([1], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        at = (s * n_tokens + t) * n_heads + h
        w = tl.exp(tl.load(ml_ptr + at + tl.zeros([1], tl.int32)) - m)
        denom += w * tl.load(ml_ptr + SPLITS * n_tokens * n_heads + at + tl.zeros([1], tl.int32))
        acc += w * tl.load(part_ptr + at * HEAD_DIM_P + d)
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a small machine, so tests exercise the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(n_tiles: int, hkv: int, sms: int) -> int:
    """Key splits per decode tile: enough programs for about four per SM, a power of two,
    at most 16 (H100, 1B shape: 2 splits at batch 64 cut the kernel from 53 to 45 us)."""
    want = -(-4 * sms // max(1, n_tiles * hkv))
    return min(16, _pow2(want)) if want > 1 else 1


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, BS, Hkv, D] (one layer)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32/int64
    tiles: torch.Tensor,  # [4, num_tiles] int32/int64: stream, first q row, tokens, position
    block_q: int,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of every query token over its own stream's paged KV (causal).

    `splits` (decode tiles only, block_q == 1): programs per tile sharing its keys; None
    picks by the tile count and the device's SMs. `scale` multiplies q k^T (default
    1/sqrt(D)); `window` limits a query at position p to keys p - window < j <= p;
    `softcap` caps the scores at +-softcap with tanh."""
    t, hq, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    if dk != d or hq % hkv:
        raise ValueError(f"heads {hq}/{hkv} and dims {d}/{dk} do not fit")
    if q.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("q needs unit stride in D; the KV cache must be contiguous")
    group = hq // hkv
    group_p = _pow2(group)
    if out is None:
        out = torch.empty_like(q)
    n_tiles = tiles.shape[1]
    if n_tiles == 0:
        return out
    d_p = max(16, _pow2(d))
    if block_q == 1:  # decode: long key steps (measured on an H100: fewer, larger loads win)
        block_n, num_warps, num_stages = 128, 4, 2
        if splits is None:
            splits = decode_splits(n_tiles, hkv, _sm_count(q.device))
    else:
        block_n, num_warps, num_stages, splits = 32, 4, 2, 1
    if splits > 1:
        part = torch.empty((splits, t, hq, d_p), dtype=torch.float32, device=q.device)
        ml = torch.empty((2, splits, t, hq), dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    kf, vf = k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d)
    _paged_attention_kernel[(n_tiles, hkv, splits)](
        q, kf, vf, out,
        block_tables, block_tables.stride(0),
        tiles[0], tiles[1], tiles[2], tiles[3],
        part, ml, t, hq,
        d**-0.5 if scale is None else scale, window or 0, softcap or 0.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kf.stride(0), kf.stride(1),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, ROWS=max(16, block_q * group_p),
        HEAD_DIM=d, HEAD_DIM_P=d_p, BS=bs, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, UPCAST=_INTERPRETED and q.dtype == torch.bfloat16,
        SPLITS=splits, WINDOWED=window is not None, SOFTCAP=softcap is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(t, hq)](
            part, ml, out, t, hq, out.stride(0), out.stride(1),
            SPLITS=splits, HEAD_DIM=d, HEAD_DIM_P=d_p,
        )
    return out
