"""Optional CUDA backend: vllm-flash-attn's varlen kernel reading paged KV through block tables.

Picked automatically on CUDA when `vllm_flash_attn` imports (install the `flash`
extra). One kernel call per layer covers every stream of the step: prefill
chunks and decode tokens together, each reading only its own blocks; causal
masking is aligned to the end of each stream's KV, which is what chunked
prefill after cached context needs.
"""

from __future__ import annotations

import torch

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.model.attention import AttentionMetadata, LayerAttention

try:
    from vllm_flash_attn import flash_attn_varlen_func
except ImportError as e:  # not a dependency: users bring a build that matches their torch
    raise ImportError(f"vllm_flash_attn is not installed ({e}); its only release (2.6.2) needs torch==2.4.0") from e


class FlashAttention:
    name = "flash"

    def __init__(self, device: torch.device, block_size: int) -> None:
        if device.type != "cuda":
            raise RuntimeError("the flash backend needs a CUDA device")
        if block_size % 16:
            raise ValueError(f"the flash backend needs block_size divisible by 16, got {block_size}")
        self.layers: list[LayerAttention] | None = None

    def configure(self, layers: list[LayerAttention]) -> None:
        self.layers = layers

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        n_blocks = max(len(t) for t in meta.block_tables)
        table = torch.zeros(meta.num_streams, n_blocks, dtype=torch.int32)
        for i, t in enumerate(meta.block_tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        cu_q = [0]
        for q in meta.query_lens:
            cu_q.append(cu_q[-1] + q)
        seq_lens = meta.seq_lens
        meta.prepared = {
            "block_table": table.to(device, non_blocking=True),
            "cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32).to(device, non_blocking=True),
            "seqused_k": torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            "max_seqlen_q": max(meta.query_lens),
            "max_seqlen_k": max(seq_lens),
        }

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
        p = meta.prepared
        extra = {}
        if self.layers is not None:  # flash-attn's own window, softcap and scale arguments
            spec = self.layers[layer]
            extra = {"softmax_scale": spec.scale, "softcap": spec.softcap or 0.0,
                     "window_size": (-1, -1) if spec.window is None else (spec.window - 1, 0)}
        return flash_attn_varlen_func(
            q=q, k=kc, v=vc,
            cu_seqlens_q=p["cu_seqlens_q"], max_seqlen_q=p["max_seqlen_q"],
            seqused_k=p["seqused_k"], max_seqlen_k=p["max_seqlen_k"],
            causal=True, block_table=p["block_table"], **extra,
        )
