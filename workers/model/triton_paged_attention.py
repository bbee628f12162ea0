"""Triton kernel: paged attention for a whole mixed step in one launch per layer.

The step's query tokens are cut into tiles; a tile is up to BLOCK_Q consecutive query
tokens of one stream (a decode token is a tile of one). One program handles one tile
and one KV head: its rows are the tile's tokens times the query heads that share that
KV head (GQA), so K/V are read once for the whole group. The program walks the stream's
keys through its block table (any block order, any block size), causal to each row's
position, with an online softmax. Prefill chunks after cached context, plain prefill
and decode tokens all take the same path.

Runs on CUDA, and on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
before this module is imported), which is how CI checks it without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # q/o: [T, Hq, D]; k/v: one layer, [num_blocks * BS, Hkv, D]
    tables_ptr, table_stride,  # [S, max_blocks] int32 or int64
    tile_stream_ptr, tile_row_ptr, tile_len_ptr, tile_pos_ptr,  # [num_tiles] each
    sm_scale,
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
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
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
    table = tables_ptr + stream * table_stride
    for start in range(0, n_keys, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < n_keys
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
        s = tl.where((j[None, :] <= pos[:, None]) & j_ok[None, :], s, -1.0e30)
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
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # empty (padding) tiles: no 0/0
    o_off = (row0 + qi)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, BS, Hkv, D] (one layer)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32/int64
    tiles: torch.Tensor,  # [4, num_tiles] int32/int64: stream, first q row, tokens, position
    block_q: int,
    out: torch.Tensor | None = None,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of every query token over its own stream's paged KV (causal)."""
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
    kf, vf = k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d)
    _paged_attention_kernel[(n_tiles, hkv)](
        q, kf, vf, out,
        block_tables, block_tables.stride(0),
        tiles[0], tiles[1], tiles[2], tiles[3],
        d**-0.5,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kf.stride(0), kf.stride(1),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, ROWS=max(16, block_q * group_p),
        HEAD_DIM=d, HEAD_DIM_P=max(16, _pow2(d)), BS=bs, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, UPCAST=_INTERPRETED and q.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
