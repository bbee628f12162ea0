"""Triton kernels for a step's LoRA deltas on CUDA, every row with its own adapter.

`lora_shrink` computes t = x @ A[slot].T and `lora_expand` adds t @ B[slot] to the base
output in place, for every token row whose slot (`token_slots`, -1: the base model) holds an
adapter. Each program reads its row's slot and that slot's rank for this linear (`ranks`, a
device table the slot loads keep current), so:
- base rows and rank blocks past an adapter's own rank do no work (a rank-8 adapter beside a
  rank-64 one costs rank-8 work: no padding to the batch's largest rank, the cost vLLM's
  Punica kernels pay);
- nothing is read on the host, so the launches have fixed shapes for a given token count.

The slot buffers are A [slots, R, K] and B [slots, R, N] (R: the slot's capacity); only the
first rank rows of a slot are read. Accumulation is in float32, rounded once into the output.
On the CPU they run under Triton's interpreter (TRITON_INTERPRET=1) for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x_ptr, a_ptr, ranks_ptr, slots_ptr, t_ptr, T, K,
                   stride_x, stride_as, stride_ar, stride_t,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0)
    rb = tl.program_id(1)
    slot = tl.load(slots_ptr + i)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        if rb * BLOCK_R < rank:
            offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
            r_ok = offs_r < rank
            acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
            a_row = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < K
                xk = tl.load(x_ptr + i.to(tl.int64) * stride_x + offs_k, mask=k_ok, other=0.0)
                a = tl.load(a_row + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                acc += tl.sum(a.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
            tl.store(t_ptr + i.to(tl.int64) * stride_t + offs_r, acc, mask=r_ok)


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(t_ptr, b_ptr, ranks_ptr, slots_ptr, out_ptr, T, N,
                   stride_t, stride_bs, stride_br, stride_out,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(slots_ptr + i)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        if rank > 0:
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            b_base = b_ptr + slot.to(tl.int64) * stride_bs
            for r0 in range(0, rank, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_ok = offs_r < rank
                tr = tl.load(t_ptr + i.to(tl.int64) * stride_t + offs_r, mask=r_ok, other=0.0)
                b = tl.load(b_base + offs_r[:, None] * stride_br + offs_n[None, :],
                            mask=r_ok[:, None] & n_ok[None, :], other=0.0)
                acc += tl.sum(tr[:, None] * b.to(tl.float32), axis=0)
            dst = out_ptr + i.to(tl.int64) * stride_out + offs_n
            old = tl.load(dst, mask=n_ok, other=0.0)
            tl.store(dst, (old.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=n_ok)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
    """t [T, R] float32: row i is x[i] @ A[slot_i, :rank].T in its first rank entries (the
    rest, and base rows, unwritten)."""
    n, k = x.shape
    r_cap = a.shape[1]
    assert x.stride(1) == 1 and a.stride(2) == 1
    t = torch.empty(n, r_cap, dtype=torch.float32, device=x.device)
    if n == 0:
        return t
    block_r = 16
    grid = (n, triton.cdiv(r_cap, block_r))
    _shrink_kernel[grid](x, a, ranks, token_slots, t, n, k, x.stride(0), a.stride(0),
                         a.stride(1), t.stride(0), BLOCK_R=block_r, BLOCK_K=128)
    return t


def lora_expand(t: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
                token_slots: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] += t[i, :rank] @ B[slot_i, :rank] for every adapter row, in place."""
    n, cols = out.shape
    assert out.stride(1) == 1 and b.stride(2) == 1
    if n == 0:
        return
    block_n = 128
    grid = (n, triton.cdiv(cols, block_n))
    _expand_kernel[grid](t, b, ranks, token_slots, out, n, cols, t.stride(0), b.stride(0),
                         b.stride(1), out.stride(0), BLOCK_R=16, BLOCK_N=block_n)
