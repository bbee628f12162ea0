"""A draft model's runner (speculative decoding): its model, its own paged KV pool and
block tables, and the forward of a step, on the target's device.

Its streams mirror the target's by request id and hold only tokens the target accepted (or
proposals of the step under way, which `truncate` drops). Prefix caching is off in its pool:
a stream cut back by `truncate` rewrites blocks it had filled, which must never be shared.
It runs eagerly (no CUDA graphs) and on one device.
"""

from __future__ import annotations

import time

import torch

from kvserve.config import EngineConfig
from kvserve.kvcache.manager import KVCacheManager, StepPlan, StreamStep
from kvserve.workers.loading.loader import LoadedModel
from kvserve.workers.model.forward import DTYPES, StepForward
from kvserve.workers.model.models.registry import build_model
from kvserve.workers.model.runner import table_geometry
from kvserve.workers.model.step_inputs import build_step


class DraftRunner(StepForward):
    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> None:
        """`config`: the target engine's; the draft keeps as many tokens of KV as the
        target's pool, in its own geometry."""
        config = config.model_copy(update={"enforce_eager": True, "enable_prefix_caching": False,
                                           "tensor_parallel_size": 1})
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = DTYPES[config.resolved_dtype()]
        cfg = loaded.config
        self.model_config = cfg
        self.max_model_len = min(max_model_len, cfg.max_position_embeddings)
        self.model = build_model(cfg, loaded.weights, self.device, self.dtype, self.max_model_len,
                                 quantized=loaded.quantized, quantized_decode=config.quantized_decode,
                                 cpu_matmul=config.cpu_matmul)
        self.block_size = config.block_size
        window, width = table_geometry(cfg, config)
        self.kv = KVCacheManager(config.num_blocks, config.block_size, False, window,
                                 max_blocks_per_stream=width, slots=config.max_num_seqs,
                                 pin_tables=self.device.type == "cuda")
        self.setup_device(cfg, config, self.kv.tables, cfg.num_kv_heads)

    def run(self, steps: list[StreamStep]) -> torch.Tensor:
        """Reserve, forward and commit one step; logits [streams, vocab]. Raises KVCacheFull
        (nothing changed) when its blocks do not fit."""
        plan: StepPlan = self.kv.reserve(steps)
        try:
            step = build_step(plan, self.block_size, self.max_model_len)
            extras = list(self.tables.pending()) if self.tables is not None else []
            logits = self.forward_step(step, [p.block_ids for p in plan.streams], extras)
        except BaseException:
            self.kv.rollback(plan)
            raise
        self.kv.commit(plan)
        return logits

    def time_rows(self, counts: list[int], vocab: int) -> list[float]:
        """Seconds of one forward of n streams' single tokens for each n in `counts`."""
        out = []
        for i, n in enumerate([counts[0], *counts]):
            sids = [f"kvserve-draft-calibration-{j}" for j in range(n)]
            steps = [StreamStep(sid, [(7 * j + 1000 * i + 1) % vocab], 1) for j, sid in enumerate(sids)]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            self.run(steps)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            out.append(time.perf_counter() - t0)
            for sid in sids:
                self.kv.free(sid)
        self.kv.pool.reset_order()
        return out[1:]
