"""Torch attention backend (CPU and CUDA), reading each stream's own KV only.

Decode tokens (one query per stream) on the CPU go to a small C kernel
(csrc/paged_decode.c) that walks every stream's block table in place, all
streams in one call per layer. Prefill chunks, and decode where the kernel is
unavailable, use one SDPA call per stream: a zero-copy view of the stream's KV
when its blocks are consecutive in the pool, else a gather of its blocks.
docs/design.md has the measurements behind this split.

With `prefill_rows` (8-bit activations, cpu_matmul int8) every prompt row also goes to
the C kernel as a decode row over the keys up to its own position: SDPA's result for a
row depends on the chunk it comes in (its tiling), and 8-bit rounding would turn that
last-bit difference into a different token, so a request's text would depend on which
earlier request computed a cached prefix. Row by row, prompt, verify and decode rows
are the same bits wherever they run.

A sliding-window layer reads only the blocks its window reaches (the C kernel starts
at the window's first block; SDPA plans gather from there and mask the rest), and a
soft-capped layer (Gemma 2) computes its scores explicitly, since SDPA cannot cap them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.model.attention import AttentionMetadata, LayerAttention, window_start


@dataclass
class _StreamPlan:
    q_start: int
    q_end: int
    seq_len: int  # keys read: the stream's KV from its first reachable block on
    first_slot: int  # >= 0: the keys are the contiguous slot range [first_slot, +seq_len)
    blocks: torch.Tensor | None  # otherwise the block ids to gather
    mask: torch.Tensor | None  # bool [q_len, seq_len]: chunks after cached context, windows
    causal: bool  # plain causal mask (chunk starts at position 0, no window)


@dataclass
class _StepPlan:
    sdpa: dict[int | None, list[_StreamPlan]]  # by window: streams attended with SDPA
    dec_rows: torch.Tensor | None  # query rows handled by the C kernel (None = all rows)
    dec_tables: torch.Tensor | None  # [n, max_blocks] int32
    dec_lens: torch.Tensor | None  # [n] int32
    all_decode: bool


def kernel_reads_kv(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether the C kernel reads a KV cache of this dtype and geometry: float32 always, a
    float16 one where its spans fit the kernel's buffers (none where it is not built)."""
    if dtype == torch.float32:
        return True
    if dtype != torch.float16:
        return False
    from kvserve.workers.model.cpu_kernels import load_paged_decode

    lib = load_paged_decode()
    return lib is not None and bool(lib.pd_kv16_fits(block_size, head_dim))


def _is_run(blocks: list[int]) -> bool:
    return all(b == blocks[0] + i for i, b in enumerate(blocks))


def _plan_stream(q0: int, qlen: int, ctx: int, table: list[int], bs: int, window: int | None,
                 device: torch.device) -> _StreamPlan:
    """How SDPA reads one stream: its keys from the first block the chunk's first query
    still sees (block 0 without a window), and the mask that leaves out the rest."""
    seq = ctx + qlen
    if window is not None and seq <= window:
        window = None  # every key is in the window: the plain causal plan (no explicit mask)
    b0 = window_start(ctx, window) // bs
    used = table[b0 : -(-seq // bs)]
    k0 = b0 * bs  # position of the first key read
    if _is_run(used):
        first, blocks = used[0] * bs, None
    else:
        first, blocks = -1, torch.tensor(used, dtype=torch.long, device=device)
    mask, causal = None, False
    if window is not None and seq - k0 > 1:
        qpos = torch.arange(ctx, seq, device=device).unsqueeze(1)
        kpos = torch.arange(k0, seq, device=device).unsqueeze(0)
        mask = (kpos <= qpos) & (kpos > qpos - window)
    elif qlen > 1:
        if ctx == 0:
            causal = True
        else:
            qpos = torch.arange(ctx, seq, device=device).unsqueeze(1)
            mask = torch.arange(seq, device=device).unsqueeze(0) <= qpos
    return _StreamPlan(q0, q0 + qlen, seq - k0, first, blocks, mask, causal)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: _StreamPlan,
                      scale: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped scores: q [n, Hq, D], k/v [L, Hkv, D] -> [n, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).float()  # [Hq, n, D]
    kh = k.repeat_interleave(rep, dim=1).transpose(0, 1).float()
    vh = v.repeat_interleave(rep, dim=1).transpose(0, 1).float()
    s = torch.tanh(qh @ kh.transpose(1, 2) * scale / cap) * cap  # [Hq, n, L]
    n, length = q.shape[0], k.shape[0]
    if p.mask is not None:
        s = s.masked_fill(~p.mask, float("-inf"))
    elif n > 1:  # causal, aligned to the end of the keys
        keep = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
        s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vh).transpose(0, 1).to(q.dtype)


class TorchAttention:
    name = "torch"

    def __init__(self, use_kernel: bool = True, prefill_rows: bool = False) -> None:
        """`prefill_rows`: prompt rows too attend through the C kernel, each as a decode row
        over the keys up to its own position, so a row's bits do not depend on the chunk it
        came in (what the 8-bit matmuls need: see `forward`)."""
        self.kernel = None
        if use_kernel:
            from kvserve.workers.model.cpu_kernels import load_paged_decode

            self.kernel = load_paged_decode()
        self.prefill_rows = prefill_rows and self.kernel is not None
        self.threads = torch.get_num_threads()
        self.layers: list[LayerAttention] | None = None  # None: plain attention everywhere
        self.windows: list[int | None] = [None]

    def configure(self, layers: list[LayerAttention]) -> None:
        self.layers = layers
        self.windows = sorted({spec.window for spec in layers}, key=lambda w: w or 0)

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        use_kernel = self.kernel is not None and device.type == "cpu"
        inp = meta.inputs
        if inp is not None and use_kernel:
            meta.prepared = self._prepare_rows(meta, inp, device)
            return
        bs = meta.block_size
        plans: dict[int | None, list[_StreamPlan]] = {w: [] for w in self.windows}
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        q0 = 0
        for qlen, ctx, table in zip(meta.query_lens, meta.context_lens, meta.block_tables, strict=True):
            if use_kernel and (qlen == 1 or self.prefill_rows):
                # the kernel applies each layer's window itself
                for i in range(qlen):
                    dec_rows.append(q0 + i)
                    dec_tables.append(table[: -(-(ctx + i + 1) // bs)])
                    dec_lens.append(ctx + i + 1)
                q0 += qlen
                continue
            for window, out in plans.items():
                out.append(_plan_stream(q0, qlen, ctx, table, bs, window, device))
            q0 += qlen
        step = _StepPlan(plans, None, None, None, all_decode=not plans[self.windows[0]])
        if dec_rows:
            width = max(len(t) for t in dec_tables)
            tab = torch.zeros(len(dec_tables), width, dtype=torch.int32)
            for i, t in enumerate(dec_tables):
                tab[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
            step.dec_tables = tab
            step.dec_lens = torch.tensor(dec_lens, dtype=torch.int32)
            if not step.all_decode:
                step.dec_rows = torch.tensor(dec_rows, dtype=torch.long)
        meta.prepared = step

    def _prepare_rows(self, meta: AttentionMetadata, inp, device: torch.device) -> _StepPlan:
        """From the runner's arrays: the decode streams' block tables are one gather from
        their rows of the persistent array (no per-stream Python); only prefill chunks get a
        per-stream SDPA plan."""
        bs = meta.block_size
        qlens, ctxs = inp.query_lens, inp.context_lens
        dec = qlens == 1
        verify = inp.verify
        if self.prefill_rows and not dec.all():  # decode-only steps keep the plain plan
            verify = np.ones(len(qlens), dtype=bool)
        if verify is not None:
            # a stream verifying proposals: each of its query rows attends as a decode row
            # over the keys up to its own position (all written before attention), so the
            # row computes exactly what a decode step at that position would
            dec = dec | verify
        n_dec = int(dec.sum())
        plans: dict[int | None, list[_StreamPlan]] = {w: [] for w in self.windows}
        mixed = n_dec < len(qlens)
        if mixed:
            q_end = inp.logits_indices + 1
            for i in np.flatnonzero(~dec).tolist():
                q, ctx = int(qlens[i]), int(ctxs[i])
                for window, out in plans.items():
                    out.append(_plan_stream(int(q_end[i]) - q, q, ctx, meta.block_tables[i], bs,
                                            window, device))
        step = _StepPlan(plans, None, None, None, all_decode=not mixed)
        if n_dec and verify is not None:
            q_end = inp.logits_indices[dec] + 1
            ql = qlens[dec]
            qrows = np.repeat(q_end - ql, ql) + (np.arange(int(ql.sum())) - np.repeat(np.cumsum(ql) - ql, ql))
            lens = inp.positions[qrows] + 1
            width = -(-int(lens.max()) // bs)
            owner = np.repeat(inp.rows[dec], ql)
            step.dec_tables = torch.from_numpy(np.ascontiguousarray(inp.tables[owner, :width]))
            step.dec_lens = torch.from_numpy(lens.astype(np.int32))
            if mixed:
                step.dec_rows = torch.from_numpy(qrows)
            return step
        if n_dec:
            rows = inp.rows if not mixed else inp.rows[dec]
            lens = (ctxs + 1) if not mixed else ctxs[dec] + 1
            width = -(-int(lens.max()) // bs)
            step.dec_tables = torch.from_numpy(np.ascontiguousarray(inp.tables[rows, :width]))
            step.dec_lens = torch.from_numpy(lens.astype(np.int32))
            if mixed:
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
        h, d = cache.num_kv_heads, cache.head_dim
        spec = self.layers[layer] if self.layers is not None else LayerAttention(d**-0.5)
        out = torch.empty_like(q)
        if step.dec_tables is not None:
            self._decode_kernel(q, kc, vc, out, step, spec)
        hq = q.shape[1]
        rep = hq // h
        # SDPA's own 1/sqrt(d) unless the model scales otherwise (bit-identical to before)
        scale = None if spec.scale == d**-0.5 else spec.scale
        kflat, vflat = kc.view(-1, h, d), vc.view(-1, h, d)
        for p in step.sdpa[spec.window]:
            if p.blocks is None:
                ks = kflat[p.first_slot : p.first_slot + p.seq_len]
                vs = vflat[p.first_slot : p.first_slot + p.seq_len]
            else:
                ks = kc.index_select(0, p.blocks).view(-1, h, d)[: p.seq_len]
                vs = vc.index_select(0, p.blocks).view(-1, h, d)[: p.seq_len]
            if ks.dtype != q.dtype:  # a float16 cache under a float32 model
                ks, vs = ks.to(q.dtype), vs.to(q.dtype)
            qlen = p.q_end - p.q_start
            if spec.softcap is not None:
                out[p.q_start : p.q_end] = _capped_attention(
                    q[p.q_start : p.q_end], ks, vs, p, spec.scale, spec.softcap)
                continue
            if qlen == 1 and p.mask is None:
                # decode: the `rep` query heads sharing a KV head become rows of one
                # query matrix, so GQA needs no K/V expansion and SDPA takes its fused kernel
                qs = q[p.q_start].view(1, h, rep, d)
                o = F.scaled_dot_product_attention(
                    qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                    scale=scale,
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
                scale=scale,
            )
            out[p.q_start : p.q_end] = o[0].transpose(0, 1)
        return out

    def _decode_kernel(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                       out: torch.Tensor, step: _StepPlan, spec: LayerAttention) -> None:
        tab, lens = step.dec_tables, step.dec_lens
        assert tab is not None and lens is not None and self.kernel is not None
        if step.dec_rows is None:
            qd, od = q.contiguous(), out
        else:
            qd = q.index_select(0, step.dec_rows)
            od = torch.empty_like(qd)
        n, hq, d = qd.shape
        _, bs, hkv, _ = kc.shape
        fn = self.kernel.paged_decode_f16 if kc.dtype == torch.float16 else self.kernel.paged_decode_f32
        rc = fn(
            qd.data_ptr(), kc.data_ptr(), vc.data_ptr(), od.data_ptr(), tab.data_ptr(),
            lens.data_ptr(), n, tab.shape[1], hq, hkv, d, bs, spec.scale, spec.window or 0,
            spec.softcap or 0.0, torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"paged decode kernel rejected the geometry (heads {hq}/{hkv}, dim {d})")
        if step.dec_rows is not None:
            out.index_copy_(0, step.dec_rows, od)
