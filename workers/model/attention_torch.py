"""Torch attention backend (CPU and CUDA), reading each stream's own KV only.

Decode tokens (one query per stream) on the CPU go to a small C kernel
(csrc/paged_decode.c) that walks every stream's block table in place, all
streams in one call per layer. Prefill chunks, and decode where the kernel is
unavailable, use one SDPA call per stream: a zero-copy view of the stream's KV
when its blocks are consecutive in the pool, else a gather of its blocks.
docs/design.md has the measurements behind this split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.model.attention import AttentionMetadata


@dataclass
class _StreamPlan:
    q_start: int
    q_end: int
    seq_len: int
    first_slot: int  # >= 0: the stream's KV is the contiguous slot range [first_slot, +seq_len)
    blocks: torch.Tensor | None  # otherwise the block ids to gather
    mask: torch.Tensor | None  # bool [q_len, seq_len] for chunks after cached context
    causal: bool  # plain causal mask (chunk starts at position 0)


@dataclass
class _StepPlan:
    sdpa: list[_StreamPlan]  # streams attended with SDPA
    dec_rows: torch.Tensor | None  # query rows handled by the C kernel (None = all rows)
    dec_tables: torch.Tensor | None  # [n, max_blocks] int32
    dec_lens: torch.Tensor | None  # [n] int32
    all_decode: bool


def _is_run(blocks: list[int]) -> bool:
    return all(b == blocks[0] + i for i, b in enumerate(blocks))


def _sdpa_plan(q0: int, qlen: int, ctx: int, used: list[int], bs: int, device: torch.device) -> _StreamPlan:
    """One stream's SDPA call: a zero-copy view of its KV when its blocks are consecutive."""
    seq = ctx + qlen
    if _is_run(used):
        first, blocks = used[0] * bs, None
    else:
        first, blocks = -1, torch.tensor(used, dtype=torch.long, device=device)
    mask, causal = None, False
    if qlen > 1:
        if ctx == 0:
            causal = True
        else:
            qpos = torch.arange(ctx, seq, device=device).unsqueeze(1)
            mask = torch.arange(seq, device=device).unsqueeze(0) <= qpos
    return _StreamPlan(q0, q0 + qlen, seq, first, blocks, mask, causal)


class TorchAttention:
    name = "torch"

    def __init__(self, use_kernel: bool = True) -> None:
        self.kernel = None
        if use_kernel:
            from kvserve.workers.model.cpu_kernels import load_paged_decode

            self.kernel = load_paged_decode()
        self.threads = torch.get_num_threads()

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        use_kernel = self.kernel is not None and device.type == "cpu"
        inp = meta.inputs
        if inp is not None and use_kernel:
            meta.prepared = self._prepare_rows(meta, inp, device)
            return
        bs = meta.block_size
        plans: list[_StreamPlan] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        q0 = 0
        for qlen, ctx, table in zip(meta.query_lens, meta.context_lens, meta.block_tables, strict=True):
            seq = ctx + qlen
            used = table[: -(-seq // bs)]
            if qlen == 1 and use_kernel:
                dec_rows.append(q0)
                dec_tables.append(used)
                dec_lens.append(seq)
                q0 += 1
                continue
            plans.append(_sdpa_plan(q0, qlen, ctx, used, bs, device))
            q0 += qlen
        step = _StepPlan(plans, None, None, None, all_decode=not plans)
        if dec_rows:
            width = max(len(t) for t in dec_tables)
            tab = torch.zeros(len(dec_tables), width, dtype=torch.int32)
            for i, t in enumerate(dec_tables):
                tab[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
            step.dec_tables = tab
            step.dec_lens = torch.tensor(dec_lens, dtype=torch.int32)
            if plans:
                step.dec_rows = torch.tensor(dec_rows, dtype=torch.long)
        meta.prepared = step

    @staticmethod
    def _prepare_rows(meta: AttentionMetadata, inp, device: torch.device) -> _StepPlan:
        """From the runner's arrays: the decode streams' block tables are one gather from
        their rows of the persistent array (no per-stream Python); only prefill chunks get a
        per-stream SDPA plan."""
        bs = meta.block_size
        qlens, ctxs = inp.query_lens, inp.context_lens
        dec = qlens == 1
        n_dec = int(dec.sum())
        plans: list[_StreamPlan] = []
        if n_dec < len(qlens):
            q_end = inp.logits_indices + 1
            for i in np.flatnonzero(~dec).tolist():
                q, ctx = int(qlens[i]), int(ctxs[i])
                used = meta.block_tables[i][: -(-(ctx + q) // bs)]
                plans.append(_sdpa_plan(int(q_end[i]) - q, q, ctx, used, bs, device))
        step = _StepPlan(plans, None, None, None, all_decode=not plans)
        if n_dec:
            rows = inp.rows if not plans else inp.rows[dec]
            lens = (ctxs + 1) if not plans else ctxs[dec] + 1
            width = -(-int(lens.max()) // bs)
            step.dec_tables = torch.from_numpy(np.ascontiguousarray(inp.tables[rows, :width]))
            step.dec_lens = torch.from_numpy(lens.astype(np.int32))
            if plans:
                step.dec_rows = torch.from_numpy(inp.logits_indices[dec])
        return step

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: DeviceKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cache.write(layer, meta.slot_mapping, k, v)
        kc, vc = cache.layer(layer)
        step: _StepPlan = meta.prepared
        out = torch.empty_like(q)
        if step.dec_tables is not None:
            self._decode_kernel(q, kc, vc, out, step)
        h, d = cache.num_kv_heads, cache.head_dim
        hq = q.shape[1]
        rep = hq // h
        kflat, vflat = kc.view(-1, h, d), vc.view(-1, h, d)
        for p in step.sdpa:
            if p.blocks is None:
                ks = kflat[p.first_slot : p.first_slot + p.seq_len]
                vs = vflat[p.first_slot : p.first_slot + p.seq_len]
            else:
                ks = kc.index_select(0, p.blocks).view(-1, h, d)[: p.seq_len]
                vs = vc.index_select(0, p.blocks).view(-1, h, d)[: p.seq_len]
            qlen = p.q_end - p.q_start
            if qlen == 1:
                # decode: the `rep` query heads sharing a KV head become rows of one
                # query matrix, so GQA needs no K/V expansion and SDPA takes its fused kernel
                qs = q[p.q_start].view(1, h, rep, d)
                o = F.scaled_dot_product_attention(
                    qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
                )
                # CUDA's SDPA may hand back a transposed layout: copy, never view
                out[p.q_start].view(h, rep, d).copy_(o[0])
                continue
            # prefill chunk: matmul-bound, so expanding K/V to every query head is cheap
            if rep > 1:
                ks = ks.repeat_interleave(rep, dim=1)
                vs = vs.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(
                q[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0),
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                attn_mask=p.mask,
                is_causal=p.causal,
            )
            out[p.q_start : p.q_end] = o[0].transpose(0, 1)
        return out

    def _decode_kernel(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                       out: torch.Tensor, step: _StepPlan) -> None:
        tab, lens = step.dec_tables, step.dec_lens
        assert tab is not None and lens is not None and self.kernel is not None
        if step.dec_rows is None:
            qd, od = q.contiguous(), out
        else:
            qd = q.index_select(0, step.dec_rows)
            od = torch.empty_like(qd)
        n, hq, d = qd.shape
        _, bs, hkv, _ = kc.shape
        rc = self.kernel.paged_decode_f32(
            qd.data_ptr(), kc.data_ptr(), vc.data_ptr(), od.data_ptr(), tab.data_ptr(),
            lens.data_ptr(), n, tab.shape[1], hq, hkv, d, bs, d**-0.5, torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"paged decode kernel rejected the geometry (heads {hq}/{hkv}, dim {d})")
        if step.dec_rows is not None:
            out.index_copy_(0, step.dec_rows, od)
