"""Triton kernels that fuse a decoder layer's small ops on CUDA.

A decode step at small batch is bound by launches and memory round trips of the ops
between the matmuls: eager torch spends ~25 kernels per layer on RMSNorm (upcast, norm,
scale, downcast), RoPE (slices, negate, concat, two products, sum, for Q and K), the K/V
cache writes, SiLU-and-mul and the residual adds. These kernels do the same arithmetic
in three launches per layer:

- `rope_cache`: rotate Q and K in place inside the fused QKV output and store K and V
  at the step's cache slots (one program per token);
- `add_rms_norm`: residual += x, then the residual's RMSNorm times the weight (one
  program per token; the residual is updated in place);
- `silu_mul`: silu(gate) * up from the fused gate/up output.

Each computes in float32 and rounds once to the activations' dtype. They run on CUDA and,
for tests, on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])  # views at any offset: no recompiles
def _rope_cache_kernel(
    qkv_ptr, stride_t,  # [T, (HQ + 2 * HKV) * D]
    pos_ptr, cos_ptr, sin_ptr,  # positions [T]; tables [max_pos, D]
    k_cache_ptr, v_cache_ptr, slot_ptr,  # caches [slots, HKV, D] (one layer); slots [T]
    HQ: tl.constexpr, HKV: tl.constexpr, HEADS_P: tl.constexpr,
    HALF: tl.constexpr, HALF_P: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_P)[:, None]
    i = tl.arange(0, HALF_P)[None, :]
    i_ok = i < HALF
    c1 = tl.load(cos_ptr + pos * 2 * HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * 2 * HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_t
    d = 2 * HALF
    # Q and K heads are contiguous in the row: heads 0..HQ-1 are Q, HQ..HQ+HKV-1 are K
    rot = (h < HQ + HKV) & i_ok
    x1 = tl.load(row + h * d + i, mask=rot, other=0.0).to(tl.float32)
    x2 = tl.load(row + h * d + HALF + i, mask=rot, other=0.0).to(tl.float32)
    y1 = (x1 * c1 - x2 * s1).to(qkv_ptr.dtype.element_ty)
    y2 = (x2 * c2 + x1 * s2).to(qkv_ptr.dtype.element_ty)
    tl.store(row + h * d + i, y1, mask=rot)
    tl.store(row + h * d + HALF + i, y2, mask=rot)
    kh = h - HQ
    is_k = (kh >= 0) & (kh < HKV) & i_ok
    dst = slot * HKV * d + kh * d + i
    tl.store(k_cache_ptr + dst, y1.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_cache_ptr + dst + HALF, y2.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    vh = tl.arange(0, HEADS_P)[:, None]
    is_v = (vh < HKV) & i_ok
    src = row + (HQ + HKV) * d + vh * d + i
    vdst = slot * HKV * d + vh * d + i
    tl.store(v_cache_ptr + vdst, tl.load(src, mask=is_v, other=0.0), mask=is_v)
    tl.store(v_cache_ptr + vdst + HALF, tl.load(src + HALF, mask=is_v, other=0.0), mask=is_v)


def rope_cache(
    qkv: torch.Tensor,  # [T, (hq + 2 * hkv) * d], rotated in place
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_pos, d]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # one layer: [num_blocks, block_size, hkv, d]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] flat cache slot of each token
    hq: int,
    hkv: int,
    d: int,
) -> torch.Tensor:
    """Rotate Q and K (neox halves) in place, store K and V at `slots`; returns Q as a
    [T, hq, d] view of `qkv`."""
    t = qkv.shape[0]
    if qkv.stride(1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("qkv needs unit stride in its last dim; cos/sin must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or d % 2:
        raise ValueError("the KV cache must be contiguous and the head dim even")
    if t:
        _rope_cache_kernel[(t,)](
            qkv, qkv.stride(0), positions, cos, sin, k_cache, v_cache, slots,
            HQ=hq, HKV=hkv, HEADS_P=_pow2(hq + hkv), HALF=d // 2, HALF_P=_pow2(d // 2),
        )
    return qkv[:, : hq * d].view(t, hq, d)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, n, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + t * n + i, mask=ok, other=0.0)
    if HAS_RES:  # residual stream += x, rounded as the unfused add would be
        x = (x.to(tl.float32) + tl.load(res_ptr + t * n + i, mask=ok, other=0.0).to(tl.float32))
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + t * n + i, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * n + i, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm(x) * weight; with `residual`, first residual += x (in place) and normalize
    the sum. x and residual are [T, n] and contiguous."""
    t, n = x.shape
    if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
        raise ValueError("add_rms_norm needs contiguous rows")
    out = torch.empty_like(x)
    if t:
        _add_rms_norm_kernel[(t,)](
            x, residual if residual is not None else x, weight, out, n, eps,
            HAS_RES=residual is not None, BLOCK=_pow2(n), num_warps=4 if n <= 4096 else 8,
        )
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < inter
    g = tl.load(gu_ptr + t * 2 * inter + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * 2 * inter + inter + i, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * inter + i, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] of shape [T, 2 * inter]."""
    t, two = gate_up.shape
    inter = two // 2
    if not gate_up.is_contiguous():
        raise ValueError("silu_mul needs contiguous rows")
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if t:
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
