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
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.errors import ConfigError, EngineDeadError
from kvserve.kvcache.host_cache import HostTier, default_host_bytes
from kvserve.kvcache.manager import KVCacheManager, StepPlan, StreamStep
from kvserve.workers.loading.loader import LoadedModel
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.loading.sharding import ShardLayout
from kvserve.workers.model.forward import DTYPES, DeviceTokens, Progress, StepForward
from kvserve.workers.model.layers.parallel import TensorParallel
from kvserve.workers.model.lora import LoRASlots
from kvserve.workers.model.models.registry import build_model
from kvserve.workers.model.step_inputs import build_step

if TYPE_CHECKING:
    from kvserve.workers.model.parallel.ranks import ShardRanks

log = logging.getLogger(__name__)

__all__ = ["DTYPES", "DeviceTokens", "ModelRunner", "Progress"]

# the restore cost model's prefill rate: tokens of the timed chunk at start-up, enough to
# fill the device (a GPU runs a small chunk in about the time of one token); real steps
# with at least half as many tokens beyond one per stream keep it current (smaller steps
# are mostly fixed cost, decode-only steps another cost per token altogether)
CALIBRATION_TOKENS = {"cpu": 128, "cuda": 512}


def table_geometry(cfg: ModelConfig, config: EngineConfig) -> tuple[int | None, int]:
    """(the window after which a stream's blocks are released, or None; the block-table
    width: the most blocks a stream holds ids for)."""
    # every layer windowed (Mistral, Phi-3 with sliding_window): blocks no window reaches
    # are released; with global layers among them (Gemma) every block stays
    window = cfg.sliding_window if cfg.sliding_window is not None and cfg.all_sliding else None
    # a windowed stream is not capped by the pool (its table keeps released ids)
    max_tokens = config.max_model_len or cfg.max_position_embeddings
    if window is None:
        max_tokens = min(max_tokens, config.num_blocks * config.block_size)
    return window, -(-max_tokens // config.block_size)


def _linears_runtime(loaded: LoadedModel, config: EngineConfig, device: torch.device,
                     dtype: torch.dtype) -> str:
    """How the linears multiply: through a C kernel on the GGUF's quantized blocks or on
    dequantized weights, and why."""
    if not loaded.quantized:
        return f"{str(dtype).removeprefix('torch.')} weights"
    if not (device.type == "cpu" and dtype == torch.float32):
        return f"dequantized to {str(dtype).removeprefix('torch.')}"
    if not config.quantized_decode:
        return "dequantized to float32 (quantized_decode off)"
    from kvserve.workers.model.cpu_kernels import kernel_states

    if config.cpu_matmul == "int8":
        state = kernel_states().get("decode_step", "")
        if state.startswith("C"):
            return "quantized blocks x 8-bit activations in the C kernel (cpu_matmul int8)"
    else:
        state = kernel_states().get("qgemv", "")
        if state.startswith("C"):
            return ("quantized blocks x float32 activations in the C kernel at small batches, "
                    "dequantized float32 above (cpu_matmul exact)")
    return f"dequantized to float32: {state}"


def _step_runtime(model: object) -> str | None:
    """Whether decode steps run as one C call (workers/model/cpu_decode.py), and why not."""
    step = getattr(model, "cpu_step", None)
    if step is None:
        return None
    if step.why_not is not None:
        return f"op by op: {step.why_not}"
    if step.repack_skipped is not None:
        return f"one C call per decode step, without repacked weights: {step.repack_skipped}"
    return "one C call per decode step"


def context_limit(cfg: ModelConfig, config: EngineConfig) -> int:
    """The longest stream (prompt + output tokens) an engine serves: the model's context (or
    `max_model_len`), and without a window on every layer also what the device KV pool holds
    for one stream, since a stream keeps all its KV on the device while it runs (others are
    parked or preempted to make room, never it cut short). A `max_model_len` the pool cannot
    hold is refused."""
    model_len = config.max_model_len or cfg.max_position_embeddings
    window, _ = table_geometry(cfg, config)
    pool = config.num_blocks * config.block_size
    if window is not None or model_len <= pool:
        return model_len
    if config.max_model_len is not None:
        raise ConfigError(
            f"max_model_len={config.max_model_len} is more than this engine's device KV pool "
            f"holds for one stream ({pool} tokens: kv_cache_tokens={config.kv_cache_tokens} in "
            f"blocks of {config.block_size}). Raise kv_cache_tokens (--kv-cache-tokens; on GPUs "
            "tensor parallelism (--tensor-parallel-size) spreads the KV over more devices' "
            f"memory), or ask for a max_model_len of at most {pool}")
    return pool


class ModelRunner(StepForward):
    def __init__(self, loaded: LoadedModel, config: EngineConfig,
                 progress: Progress | None = None, ranks: ShardRanks | None = None) -> None:
        """`ranks`: the other ranks of a tensor-parallel engine (`parallel/ranks.py`), started
        and joined; `loaded` is then rank 0's shard."""
        self.config = config
        self.ranks = ranks
        self.device = torch.device(config.resolved_device() if ranks is None else ranks.devices[0])
        self.dtype = DTYPES[config.resolved_dtype()]
        if self.device.type == "cpu" and (config.num_threads is not None or ranks is not None):
            torch.set_num_threads(config.rank_threads())
        cfg = loaded.config
        self.model_config = cfg
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        tp = None
        num_kv_heads = cfg.num_kv_heads
        if ranks is not None:
            assert loaded.shard is not None
            layout = ShardLayout(cfg, loaded.shard)
            tp = TensorParallel(layout, ranks.group)
            num_kv_heads = layout.num_kv_heads
        self.model = build_model(
            cfg, loaded.weights, self.device, self.dtype, self.max_model_len,
            quantized=loaded.quantized, quantized_decode=config.quantized_decode,
            cpu_matmul=config.cpu_matmul, tp=tp,
        )
        # LoRA: the adapted linears get their device slots before any graph is captured
        self.lora: LoRASlots | None = None
        if config.lora_enabled:
            self.lora = LoRASlots(self.model, config.max_loras, config.max_lora_rank)
            step = getattr(self.model, "cpu_step", None)
            if step is not None and step.why_not is None:
                # the one-call step reads the base weights' blocks and would skip the adapters
                step.why_not = "LoRA adapters run op by op"
        self.block_size = config.block_size
        on_cuda = self.device.type == "cuda"
        window, width = table_geometry(cfg, config)
        # a row of the persistent block tables per running stream, as wide as a stream can grow
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 window, max_blocks_per_stream=width,
                                 slots=config.max_num_seqs, pin_tables=on_cuda)
        # a tensor-parallel rank 0 sends the tables' changes to the others with each step
        tables = self.kv.tables if ranks is None else ranks.track_tables(self.kv.tables)
        self.setup_device(cfg, config, tables, num_kv_heads, progress)
        self.runtime["linears"] = _linears_runtime(loaded, config, self.device, self.dtype)
        step = _step_runtime(self.model)
        if step is not None:
            self.runtime["decode_step"] = step
        log.info("runtime: %s", "; ".join(f"{k}: {v}" for k, v in self.runtime.items()))
        self.host: HostTier | None = None
        host_bytes = (default_host_bytes() if config.host_cache_gib is None
                      else int(config.host_cache_gib * 2**30))
        # host_cache_gib is the worker's: every rank keeps its shard of each host block
        n_host = host_bytes // self.bytes_per_block
        # CUDA: steps timed for the prefill rate, by events read once they have fired
        self._step_events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self._calibration_tokens = min(CALIBRATION_TOKENS.get(self.device.type, 128),
                                       config.max_num_batched_tokens,
                                       self.max_model_len - 1, config.num_blocks * config.block_size)
        self._sample_tokens = max(1, self._calibration_tokens // 2)
        if n_host >= 1:
            make = None if ranks is None else ranks.copier(cfg.num_kv_heads)
            self.host = HostTier(self.cache.kv, n_host, config.block_size,
                                 config.host_restore_policy, make)
            self.kv.attach_host(self.host)
            log.info("host KV tier: %d blocks (%.2f GiB)", n_host, n_host * self.bytes_per_block / 2**30)
        if ranks is not None:
            ranks.start_host(max(0, n_host))  # before calibration: its copies reach every rank
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

    def time_forward(self, counts: list[int]) -> list[float]:
        """Seconds of one forward of n rows (a prompt chunk from position 0) for each n in
        `counts`, after a warm-up; the caches and the allocator's order are left as new."""
        kv = self.kv
        vocab = self.model_config.vocab_size
        sid = "kvserve-calibration"
        out = []
        for i, n in enumerate([min(16, max(counts)), *counts]):
            ids = [(7 * j + 1000 * i + 1) % vocab for j in range(n)]  # no prefix hits
            self._sync()
            t0 = time.perf_counter()
            self.execute([StreamStep(sid, ids, n)])
            self._sync()
            out.append(time.perf_counter() - t0)
            kv.free(sid)
        self._step_events.clear()
        kv.reset_prefix_cache()
        kv.pool.reset_order()
        kv.prefix_queries = kv.prefix_hits = 0
        return out[1:]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def bytes_per_block(self) -> int:
        """One KV block's bytes over every rank (a replicated KV head counts on each)."""
        size = 1 if self.ranks is None else self.ranks.size
        return self.cache.bytes_per_block * size

    def execute(self, steps: list[StreamStep]) -> tuple[StepPlan, torch.Tensor]:
        """Run one step; returns the plan and one row of logits per stream ([B, vocab]).

        Raises KVCacheFull (nothing changed) if the step's blocks do not fit.
        """
        plan = self.kv.reserve(steps)
        return plan, self.run(plan)

    def run(self, plan: StepPlan, prev: DeviceTokens | None = None,
            lora: np.ndarray | None = None) -> torch.Tensor:
        """Apply a reserved plan: forward, then commit; on any error roll the plan back.
        `lora`: each planned stream's adapter slot (-1: the base), or None (all base)."""
        logits = self.launch(plan, prev, lora)
        self.kv.commit(plan)
        return logits

    def launch(self, plan: StepPlan, prev: DeviceTokens | None = None,
               lora: np.ndarray | None = None) -> torch.Tensor:
        """The plan's forward (on CUDA: queued, not waited for); on any error the plan is
        rolled back. The caller commits it (`kv.commit`) once its tokens are known."""
        try:
            self._move_blocks(plan)
            if self.host is None or plan.num_tokens - len(plan.streams) < self._sample_tokens:
                return self._forward(plan, prev, lora)
            return self._timed_forward(plan, prev, lora)
        except BaseException:
            self.kv.rollback(plan)
            raise

    def _timed_forward(self, plan: StepPlan, prev: DeviceTokens | None,
                       lora: np.ndarray | None) -> torch.Tensor:
        """A step with prompt tokens, timed into the cost model's prefill rate (on CUDA by
        events on the compute stream, read in a later step once they have fired)."""
        host = self.host
        assert host is not None
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            logits = self._forward(plan, prev, lora)
            host.cost.observe_prefill(plan.num_tokens, time.perf_counter() - t0)
            return logits
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = self._forward(plan, prev, lora)
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

    def _forward(self, plan: StepPlan, prev: DeviceTokens | None = None,
                 lora: np.ndarray | None = None) -> torch.Tensor:
        step = build_step(plan, self.block_size, self.max_model_len)
        # a step with adapters runs eagerly (its rows' adapters are not part of any graph)
        eager = self.lora is not None and self.lora.set_step(lora, step.query_lens)
        # what follows the step's own inputs in its one copy: table changes, device ids
        extras: list[np.ndarray] = []
        if self.ranks is None:
            if self.tables is not None:
                extras += self.tables.pending()
            if prev is not None and len(prev.streams):
                extras += [step.logits_indices[prev.streams], prev.rows]
            return self.forward_step(step, [p.block_ids for p in plan.streams], extras, prev, eager)
        self.ranks.send_step(step)  # the same inputs to every rank, then the same forward
        try:
            if self.tables is not None:
                extras += self.tables.pending()
            return self.forward_step(step, [p.block_ids for p in plan.streams], extras)
        except EngineDeadError:
            raise
        except BaseException as e:  # the other ranks may wait for this one in a collective
            raise self.ranks.fail(f"rank 0's step failed: {e!r}") from e

    def free(self, stream_id: str) -> None:
        self.kv.free(stream_id)

    def parallel_stats(self) -> dict[str, float | int]:
        """A tensor-parallel engine's size and rank 0's time in collectives (CPU: wall time;
        on CUDA the collectives run inside the forward and are not timed); {} otherwise."""
        if self.ranks is None:
            return {}
        g = self.ranks.group
        return {"tensor_parallel_size": self.ranks.size, "tp_collectives": g.calls,
                "tp_collective_seconds": g.seconds, "tp_collective_bytes": g.bytes}

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (no process is left behind)."""
        if self.ranks is not None:
            self.ranks.close()
