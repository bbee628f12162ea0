"""Torch attention backend: one SDPA call per stream over its own KV.

Measured on the 2-core CPU (see docs/benchmarks.md): gathering every stream
into a padded batch makes each stream pay for the longest one and copies the
KV once more per step; per-stream SDPA reads each stream's blocks in place
when they are consecutive in the pool (a zero-copy view) and gathers only
scattered tables, at the price of a Python call per stream and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.attention import AttentionMetadata


@dataclass
class _StreamPlan:
    q_start: int
    q_end: int
    seq_len: int
    first_slot: int  # >= 0: the stream's KV is the contiguous slot range [first_slot, +seq_len)
    blocks: torch.Tensor | None  # otherwise the block ids to gather
    mask: torch.Tensor | None  # bool [q_len, seq_len] for chunks after cached context
    causal: bool  # plain causal mask (chunk starts at position 0)


def _is_run(blocks: list[int]) -> bool:
    return all(b == blocks[0] + i for i, b in enumerate(blocks))


class TorchAttention:
    name = "torch"

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        bs = meta.block_size
        plans: list[_StreamPlan] = []
        q0 = 0
        for qlen, ctx, table in zip(meta.query_lens, meta.context_lens, meta.block_tables, strict=True):
            seq = ctx + qlen
            used = table[: -(-seq // bs)]
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
            plans.append(_StreamPlan(q0, q0 + qlen, seq, first, blocks, mask, causal))
            q0 += qlen
        meta.prepared = plans

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
        h, d = cache.num_kv_heads, cache.head_dim
        hq = q.shape[1]
        rep = hq // h
        kflat, vflat = kc.view(-1, h, d), vc.view(-1, h, d)
        out = torch.empty_like(q)
        for p in meta.prepared:
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
                out[p.q_start] = o.view(hq, d)
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
