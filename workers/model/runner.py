"""ModelRunner: one forward step for a mixed batch of streams over the paged KV cache.

Prefill chunks and single decode tokens are packed together without padding.
The step follows plan-then-apply: every block it writes is reserved first
(all or nothing), the forward runs, and only then is the cache state advanced;
if the forward raises, the reservation is rolled back and the cache is as it was.

Under asynchronous scheduling a step is launched before the tokens of the step before
it reach the host: those streams' input ids are taken on the device from that step's
sampled ids (`DeviceTokens`), and the engine commits the plan once it knows them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.kvcache.block_tables import BlockTables
from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.kvcache.host_cache import HostTier, default_host_bytes
from kvserve.kvcache.manager import KVCacheManager, StepPlan, StreamStep
from kvserve.workers.loading.loader import LoadedModel
from kvserve.workers.model.attention import AttentionMetadata, select_backend
from kvserve.workers.model.models.registry import build_model
from kvserve.workers.model.step_inputs import build_step, to_device

if TYPE_CHECKING:  # needs triton: imported only where graphs are used
    from kvserve.workers.model.cuda_graphs import StepGraphs

log = logging.getLogger(__name__)

# the restore cost model's prefill rate: tokens of the timed chunk at start-up, enough to
# fill the device (a GPU runs a small chunk in about the time of one token); real steps
# with at least half as many tokens beyond one per stream keep it current (smaller steps
# are mostly fixed cost, decode-only steps another cost per token altogether)
CALIBRATION_TOKENS = {"cpu": 128, "cuda": 512}

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# hears start-up stages: "loading", "capturing graphs 3/9"
Progress = Callable[[str], None]


@dataclass
class DeviceTokens:
    """Input ids a step takes from an earlier step's sampled ids, still on the device."""

    streams: np.ndarray  # indices, in this step's plan, of the streams whose input they are
    rows: np.ndarray  # each one's row in `tokens`
    tokens: torch.Tensor  # [R] int64 sampled ids of the earlier step


class DeviceTables:
    """The device copy of the persistent block tables (CUDA): a step's changed entries
    travel with its inputs and are applied by one scatter before its forward."""

    def __init__(self, tables: BlockTables, device: torch.device) -> None:
        self.src = tables
        tables.track = True
        self.device = device
        self._upload()

    def _upload(self) -> None:
        self.capacity = self.src.capacity_changes
        self.tensor = torch.from_numpy(self.src.array).to(self.device)
        self.src.take_updates()  # the whole copy holds them

    def pending(self) -> tuple[np.ndarray, np.ndarray]:
        """(flat indices, values) to apply before the next forward."""
        if self.src.capacity_changes != self.capacity:  # more streams than planned for
            self._upload()
        return self.src.take_updates()

    def apply(self, idx: torch.Tensor, vals: torch.Tensor) -> None:
        if idx.numel():
            self.tensor.view(-1).index_copy_(0, idx, vals.to(torch.int32))


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
        on_cuda = self.device.type == "cuda"
        # every layer windowed (Mistral, Phi-3 with sliding_window): blocks no window reaches
        # are released; with global layers among them (Gemma) every block stays
        window = cfg.sliding_window if cfg.sliding_window is not None and cfg.all_sliding else None
        # a windowed stream is not capped by the pool (its table keeps released ids)
        max_tokens = self.max_model_len
        if window is None:
            max_tokens = min(max_tokens, config.num_blocks * config.block_size)
        # a row of the persistent block tables per running stream, as wide as a stream can grow
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 window, max_blocks_per_stream=-(-max_tokens // config.block_size),
                                 slots=config.max_num_seqs, pin_tables=on_cuda)
        self.tables = DeviceTables(self.kv.tables, self.device) if on_cuda else None
        self.attn = select_backend(config.attention_backend, self.device, config.block_size, self.dtype)
        self.attn.configure(self.model.attention_layers)
        log.info("attention backend: %s", self.attn.name)
        use_graphs = on_cuda and not config.enforce_eager and self.attn.name == "triton"
        # with CUDA graphs, one block past the pool takes the padding rows' K/V writes
        self.cache = DeviceKVCache(
            cfg.num_layers, config.num_blocks + int(use_graphs), config.block_size,
            cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
        )
        self.graphs: StepGraphs | None = None
        if use_graphs:
            from kvserve.workers.model.cuda_graphs import StepGraphs

            assert self.tables is not None
            t = self.kv.tables
            self.graphs = StepGraphs(self.model, self.cache, self.attn, config.max_num_seqs,
                                     self.tables.tensor, config.num_blocks,
                                     max_tokens=min(config.max_num_batched_tokens,
                                                    config.cuda_graph_max_tokens),
                                     extra=2 * t.slots * t.width + 2 * config.max_num_seqs)
            log.info("capturing CUDA graphs: decode batches %s, %d mixed buckets",
                     self.graphs.buckets, len(self.graphs.mixed))
            self.graphs.capture(progress)
        self.host: HostTier | None = None
        host_bytes = (default_host_bytes() if config.host_cache_gib is None
                      else int(config.host_cache_gib * 2**30))
        n_host = host_bytes // self.cache.bytes_per_block
        # CUDA: steps timed for the prefill rate, by events read once they have fired
        self._step_events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self._calibration_tokens = min(CALIBRATION_TOKENS.get(self.device.type, 128),
                                       config.max_num_batched_tokens,
                                       self.max_model_len - 1, config.num_blocks * config.block_size)
        self._sample_tokens = max(1, self._calibration_tokens // 2)
        if n_host >= 1:
            self.host = HostTier(self.cache.kv, n_host, config.block_size, config.host_restore_policy)
            self.kv.attach_host(self.host)
            log.info("host KV tier: %d blocks (%.2f GiB)", n_host, n_host * self.cache.bytes_per_block / 2**30)
            self.calibrate()

    def calibrate(self) -> None:
        """Measure what the restore cost model compares: copy bandwidth and latency each way
        (a few blocks through the real copy path) and the prefill rate (a timed prefill chunk
        after a short warm-up one). Runs at start-up, before any stream; leaves the caches
        as it found them."""
        host = self.host
        if host is None:
            return
        kv = self.kv
        host.calibrate(list(range(kv.num_blocks)))
        n = self._calibration_tokens
        if n < 1:
            return
        vocab = self.model_config.vocab_size
        ids = [(7 * i + 1) % vocab for i in range(n)]
        seconds = 0.0
        for tokens in (min(16, n), n):
            sid = "kvserve-calibration"
            self._sync()
            t0 = time.perf_counter()
            self.execute([StreamStep(sid, ids[:tokens], tokens)])
            self._sync()
            seconds = time.perf_counter() - t0
            kv.free(sid)
        host.cost.set_prefill(n, seconds)
        self._step_events.clear()
        kv.reset_prefix_cache()
        kv.pool.reset_order()
        kv.prefix_queries = kv.prefix_hits = 0
        log.info("restore cost model: copies %.2f GB/s out, %.2f GB/s in; prefill %.0f tokens/s",
                 host.cost.gbps("out"), host.cost.gbps("in"), host.cost.prefill_tokens_per_s)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute(self, steps: list[StreamStep]) -> tuple[StepPlan, torch.Tensor]:
        """Run one step; returns the plan and one row of logits per stream ([B, vocab]).

        Raises KVCacheFull (nothing changed) if the step's blocks do not fit.
        """
        plan = self.kv.reserve(steps)
        return plan, self.run(plan)

    def run(self, plan: StepPlan, prev: DeviceTokens | None = None) -> torch.Tensor:
        """Apply a reserved plan: forward, then commit; on any error roll the plan back."""
        logits = self.launch(plan, prev)
        self.kv.commit(plan)
        return logits

    def launch(self, plan: StepPlan, prev: DeviceTokens | None = None) -> torch.Tensor:
        """The plan's forward (on CUDA: queued, not waited for); on any error the plan is
        rolled back. The caller commits it (`kv.commit`) once its tokens are known."""
        try:
            self._move_blocks(plan)
            if self.host is None or plan.num_tokens - len(plan.streams) < self._sample_tokens:
                return self._forward(plan, prev)
            return self._timed_forward(plan, prev)
        except BaseException:
            self.kv.rollback(plan)
            raise

    def _timed_forward(self, plan: StepPlan, prev: DeviceTokens | None) -> torch.Tensor:
        """A step with prompt tokens, timed into the cost model's prefill rate (on CUDA by
        events on the compute stream, read in a later step once they have fired)."""
        host = self.host
        assert host is not None
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            logits = self._forward(plan, prev)
            host.cost.observe_prefill(plan.num_tokens, time.perf_counter() - t0)
            return logits
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = self._forward(plan, prev)
        end.record()
        self._step_events.append((start, end, plan.num_tokens))
        return logits

    def _fold_timings(self) -> None:
        """Fold fired CUDA events (steps, copies) into the cost model; never waits."""
        host = self.host
        assert host is not None
        while self._step_events and self._step_events[0][1].query():
            start, end, tokens = self._step_events.pop(0)
            host.cost.observe_prefill(tokens, start.elapsed_time(end) / 1e3)
        if host.copier.pending_timings:
            host.copier.settle()

    def _move_blocks(self, plan: StepPlan) -> None:
        """Host-tier copies a step needs before its forward: first save cached blocks the
        step reuses (demotion), then copy restored blocks in (they may land in those)."""
        if self.host is None:
            return
        if self.device.type == "cuda":
            self._fold_timings()
        if plan.demoted:
            self.host.demote(plan.demoted)
            plan.demoted = []
        pairs = [hd for p in plan.restores for hd in p.host_in]
        if pairs:
            self.host.restore([h for h, _ in pairs], [d for _, d in pairs])

    def _forward(self, plan: StepPlan, prev: DeviceTokens | None = None) -> torch.Tensor:
        step = build_step(plan, self.block_size, self.max_model_len)
        # what follows the step's own inputs in its one copy: table changes, device ids
        extras: list[np.ndarray] = []
        if self.tables is not None:
            extras += self.tables.pending()
        if prev is not None and len(prev.streams):
            extras += [step.logits_indices[prev.streams], prev.rows]
        graphs = self.graphs
        if graphs is not None and graphs.tables is self._device_tables():
            key = graphs.key_for(step, sum(a.size for a in extras))
            if key is not None:
                views = graphs.stage(key, step, extras)
                self._apply(views, graphs.views(key)["ids"], prev)
                return graphs.run(step, key)
        meta = AttentionMetadata(
            query_lens=step.query_lens.tolist(), context_lens=step.context_lens.tolist(),
            block_tables=[p.block_ids for p in plan.streams], slot_mapping=None,  # type: ignore[arg-type]
            block_size=self.block_size, inputs=step, device_tables=self._device_tables(),
        )
        dev = self.device
        extra = self.attn.host_plan(meta) if hasattr(self.attn, "host_plan") else []
        parts = [step.input_ids, step.positions, step.slot_mapping, step.logits_indices, *extra, *extras]
        views = to_device(parts, dev)
        ids, pos, slots, last = views[:4]
        meta.slot_mapping = slots
        self._apply(views[4 + len(extra):], ids, prev)
        if extra:
            self.attn.bind(meta, views[4 : 4 + len(extra)])  # type: ignore[attr-defined]
        else:
            self.attn.prepare(meta, dev)
        return self.model.forward(ids, pos, meta, self.cache, self.attn, last)

    def _device_tables(self) -> torch.Tensor | None:
        return self.tables.tensor if self.tables is not None else None

    def _apply(self, extras: list[torch.Tensor], ids: torch.Tensor, prev: DeviceTokens | None) -> None:
        """On the device, before the forward: the table changes, then the ids still there."""
        if self.tables is not None:
            self.tables.apply(extras[0], extras[1])
            extras = extras[2:]
        if extras:
            assert prev is not None
            dst, rows = extras
            ids.index_copy_(0, dst, prev.tokens.index_select(0, rows))

    def free(self, stream_id: str) -> None:
        self.kv.free(stream_id)
