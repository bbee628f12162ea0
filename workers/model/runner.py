"""ModelRunner: one forward step for a mixed batch of streams over the paged KV cache.

Prefill chunks and single decode tokens are packed together without padding.
The step follows plan-then-apply: every block it writes is reserved first
(all or nothing), the forward runs, and only then is the cache state advanced;
if the forward raises, the reservation is rolled back and the cache is as it was.
"""

from __future__ import annotations

import logging

import torch

from kvserve.config import EngineConfig
from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.kvcache.host_cache import HostTier, default_host_bytes
from kvserve.kvcache.manager import KVCacheManager, StepPlan, StreamStep
from kvserve.workers.loading.loader import LoadedModel
from kvserve.workers.model.attention import AttentionMetadata, select_backend
from kvserve.workers.model.llama import LlamaModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = DTYPES[config.resolved_dtype()]
        if config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        cfg = loaded.config
        self.model_config = cfg
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.model = LlamaModel(
            cfg, loaded.weights, self.device, self.dtype, self.max_model_len,
            quantized=loaded.quantized, quantized_decode=config.quantized_decode,
        )
        self.block_size = config.block_size
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.cache = DeviceKVCache(
            cfg.num_layers, config.num_blocks, config.block_size,
            cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
        )
        self.attn = select_backend(config.attention_backend, self.device, config.block_size, self.dtype)
        log.info("attention backend: %s", self.attn.name)
        self.host: HostTier | None = None
        host_bytes = (default_host_bytes() if config.host_cache_gib is None
                      else int(config.host_cache_gib * 2**30))
        n_host = host_bytes // self.cache.bytes_per_block
        if n_host >= 1:
            self.host = HostTier(self.cache.kv, n_host, config.block_size)
            self.kv.attach_host(self.host)
            log.info("host KV tier: %d blocks (%.2f GiB)", n_host, n_host * self.cache.bytes_per_block / 2**30)

    def execute(self, steps: list[StreamStep]) -> tuple[StepPlan, torch.Tensor]:
        """Run one step; returns the plan and one row of logits per stream ([B, vocab]).

        Raises KVCacheFull (nothing changed) if the step's blocks do not fit.
        """
        plan = self.kv.reserve(steps)
        return plan, self.run(plan)

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Apply a reserved plan: forward, then commit; on any error roll the plan back."""
        try:
            self._move_blocks(plan)
            logits = self._forward(plan)
        except BaseException:
            self.kv.rollback(plan)
            raise
        self.kv.commit(plan)
        return logits

    def _move_blocks(self, plan: StepPlan) -> None:
        """Host-tier copies a step needs before its forward: first save cached blocks the
        step reuses (demotion), then copy restored blocks in (they may land in those)."""
        if self.host is None:
            return
        if plan.demoted:
            self.host.demote(plan.demoted)
            plan.demoted = []
        pairs = [hd for p in plan.streams for hd in p.host_in]
        if pairs:
            self.host.restore([h for h, _ in pairs], [d for _, d in pairs])

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        qlens, ctxs, tables = [], [], []
        for p in plan.streams:
            toks = plan.token_ids[p.stream_id]
            if p.target > self.max_model_len:
                raise ValueError(f"stream {p.stream_id}: {p.target} tokens exceed max_model_len {self.max_model_len}")
            ids.extend(toks[p.start : p.target])
            rng = range(p.start, p.target)
            pos.extend(rng)
            table = p.block_ids
            slots.extend(table[i // bs] * bs + i % bs for i in rng)
            last.append(len(ids) - 1)
            qlens.append(p.target - p.start)
            ctxs.append(p.start)
            tables.append(table)
        dev = self.device
        meta = AttentionMetadata(
            query_lens=qlens, context_lens=ctxs, block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), block_size=bs,
        )
        self.attn.prepare(meta, dev)
        return self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            meta, self.cache, self.attn,
            torch.tensor(last, dtype=torch.long, device=dev),
        )

    def free(self, stream_id: str) -> None:
        self.kv.free(stream_id)
