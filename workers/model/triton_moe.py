"""Fused Mixture-of-Experts on CUDA: grouped GEMMs over tokens sorted by expert.

A step's T tokens each pick k experts: T * k (token, expert) pairs. `align` sorts the pairs
by expert and pads each expert's run to a multiple of BLOCK_M, so every BLOCK_M-row tile of
the sorted list belongs to one expert; padding rows hold the sentinel T * k. Two kernels then
run one program per (tile, output columns):

- `_gate_up_kernel`: the tile's token rows of x times its expert's [gate | up] weights, and
  silu(gate) * up in float32, stored per pair ([T * k, F]);
- `_down_kernel`: those rows times the expert's down weights, scaled by the pair's router
  weight, stored per pair in float32 ([T * k, H]).

The k rows of a token are summed at the end (a fixed-order sum: no atomics, deterministic).
Every shape depends on T, k and the expert count only, never on the routing, and nothing
is read back to the host (the tiles past the padded total exit at once), so a decode step
with this path is capturable in a CUDA graph. Runs on CUDA and, for tests, on CPU tensors
under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def align(ids: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids [P], each tile's expert [P / block_m], padded total [1]) for the top-k
    expert ids [T, k]; P = T * k + E * (block_m - 1) rounded up to block_m, the most padding
    any routing needs. Fixed shapes, torch ops only, no host sync."""
    flat = ids.flatten().long()
    n = flat.numel()
    dev = flat.device
    p = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    dest = ends[expert] - padded[expert] + rank
    sorted_ids = torch.full((p,), n, dtype=torch.long, device=dev).scatter_(0, dest, order)
    tile_start = torch.arange(0, p, block_m, device=dev)
    tile_expert = torch.searchsorted(ends, tile_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, tile_expert, ends[-1:]


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter multiplies bfloat16 blocks through float32
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr,  # x [T, H]; w [E, 2F, H]; out [T * k, F]
    sorted_ptr, tile_expert_ptr, total_ptr,
    n_pairs, H, F, stride_xt, stride_we, stride_wn, stride_ot,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < n_pairs
    token = pair // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < F
    w_base = w_ptr + e * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ks_ok = ks < H
        a = tl.load(x_ptr + token[:, None] * stride_xt + ks[None, :],
                    mask=valid[:, None] & ks_ok[None, :], other=0.0)
        w_mask = ks_ok[:, None] & cols_ok[None, :]
        wg = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_base + (F + cols[None, :]) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        acc_g += _dot(a, wg, IEEE, UPCAST)
        acc_u += _dot(a, wu, IEEE, UPCAST)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(out_ptr + pair[:, None] * stride_ot + cols[None, :], h.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & cols_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, out_ptr, weight_ptr,  # h [T * k, F]; w [E, H, F]; out [T * k, H]; weights [T * k]
    sorted_ptr, tile_expert_ptr, total_ptr,
    n_pairs, H, F, stride_ht, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < n_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < H
    w_base = w_ptr + e * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ks_ok = ks < F
        a = tl.load(h_ptr + pair[:, None] * stride_ht + ks[None, :],
                    mask=valid[:, None] & ks_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                    mask=ks_ok[:, None] & cols_ok[None, :], other=0.0)
        acc += _dot(a, w, IEEE, UPCAST)
    weight = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_ptr + pair[:, None] * stride_ot + cols[None, :], acc,
             mask=valid[:, None] & cols_ok[None, :])


def _tiles(n_pairs: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by the mean pairs per expert: a few (decode)
    want short tiles, so little of each is padding; prefill wants tall ones, so each weight
    tile is read by fewer programs. A first choice, not yet tuned on a GPU."""
    mean = n_pairs / num_experts
    if mean <= 16:
        return 16, 64, 64, 4
    if mean <= 48:
        return 32, 64, 64, 4
    return 64, 64, 32, 4


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]) for each token t, an expert being
    down(silu(gate(x)) * up(x)) with w13 [E, 2F, H] ([gate | up] rows) and w2 [E, H, F].
    x [T, H]; weights and ids [T, k]. Returns [T, H] in x's dtype."""
    t, h = x.shape
    e, two_f, h_w = w13.shape
    f = two_f // 2
    if h_w != h or tuple(w2.shape) != (e, h, f) or weights.shape != ids.shape:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, routing {tuple(ids.shape)} do not fit")
    k = ids.shape[1]
    n = t * k
    bm, bn, bk, warps = _tiles(n, e)
    if block_m is not None:
        bm = block_m
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_ids, tile_expert, total = align(ids, e, bm)
    tiles = sorted_ids.numel() // bm
    inter = torch.empty((n, f), dtype=x.dtype, device=x.device)
    out = torch.empty((n, h), dtype=torch.float32, device=x.device)
    flags = dict(IEEE=x.dtype == torch.float32, UPCAST=_INTERPRETED and x.dtype != torch.float32)
    _gate_up_kernel[(tiles, triton.cdiv(f, bn))](
        x, w13, inter, sorted_ids, tile_expert, total,
        n, h, f, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        TOP_K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **flags,
    )
    _down_kernel[(tiles, triton.cdiv(h, bn))](
        inter, w2, out, weights.contiguous().view(-1), sorted_ids, tile_expert, total,
        n, h, f, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **flags,
    )
    return out.view(t, k, h).sum(dim=1).to(x.dtype)
