"""ModelRunner: one forward step for a mixed batch of streams over the paged KV cache.

Prefill chunks and single decode tokens are packed together without padding.
The step follows plan-then-apply: every block it writes is reserved first
(all or nothing), the forward runs, and only then is the cache state advanced;
if the forward raises, the reservation is rolled back and the cache is as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvserve.config import EngineConfig
from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.kvcache.host_cache import HostTier, default_host_bytes
from kvserve.kvcache.manager import KVCacheManager, StepPlan, StreamStep
from kvserve.workers.loading.loader import LoadedModel
from kvserve.workers.model.attention import AttentionMetadata, select_backend
from kvserve.workers.model.models.registry import build_model
from kvserve.workers.model.step_inputs import build_step, to_device

if TYPE_CHECKING:  # needs triton: imported only where graphs are used
    from kvserve.workers.model.cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# hears start-up stages: "loading", "capturing graphs 3/9"
Progress = Callable[[str], None]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig,
                 progress: Progress | None = None) -> None:
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = DTYPES[config.resolved_dtype()]
        if config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        cfg = loaded.config
        self.model_config = cfg
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.model = build_model(
            cfg, loaded.weights, self.device, self.dtype, self.max_model_len,
            quantized=loaded.quantized, quantized_decode=config.quantized_decode,
        )
        self.block_size = config.block_size
        # every layer windowed (Mistral, Phi-3 with sliding_window): blocks no window reaches
        # are released; with global layers among them (Gemma) every block stays
        window = cfg.sliding_window if cfg.sliding_window is not None and cfg.all_sliding else None
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 window)
        self.attn = select_backend(config.attention_backend, self.device, config.block_size, self.dtype)
        self.attn.configure(self.model.attention_layers)
        log.info("attention backend: %s", self.attn.name)
        use_graphs = self.device.type == "cuda" and not config.enforce_eager and self.attn.name == "triton"
        # with CUDA graphs, one block past the pool takes the padding rows' K/V writes
        self.cache = DeviceKVCache(
            cfg.num_layers, config.num_blocks + int(use_graphs), config.block_size,
            cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
        )
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            from kvserve.workers.model.cuda_graphs import DecodeGraphs

            max_tokens = min(self.max_model_len, config.num_blocks * config.block_size)
            self.graphs = DecodeGraphs(self.model, self.cache, self.attn, config.max_num_seqs,
                                       -(-max_tokens // config.block_size), config.num_blocks)
            log.info("capturing CUDA graphs for decode batches %s", self.graphs.buckets)
            self.graphs.capture(progress)
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
        step = build_step(plan, self.block_size, self.max_model_len)
        if self.graphs is not None and self.graphs.fits(step):
            return self.graphs.run(step)
        meta = AttentionMetadata(
            query_lens=step.query_lens.tolist(), context_lens=step.context_lens.tolist(),
            block_tables=[p.block_ids for p in plan.streams], slot_mapping=None,  # type: ignore[arg-type]
            block_size=self.block_size, block_table_array=step.block_tables,
        )
        dev = self.device
        extra = self.attn.host_plan(meta) if hasattr(self.attn, "host_plan") else []
        parts = [step.input_ids, step.positions, step.slot_mapping, step.logits_indices, *extra]
        views = to_device(parts, dev)
        ids, pos, slots, last = views[:4]
        meta.slot_mapping = slots
        if extra:
            self.attn.bind(meta, views[4:])  # type: ignore[attr-defined]
        else:
            self.attn.prepare(meta, dev)
        return self.model.forward(ids, pos, meta, self.cache, self.attn, last)

    def free(self, stream_id: str) -> None:
        self.kv.free(stream_id)
