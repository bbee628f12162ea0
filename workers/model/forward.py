"""A rank's device side of a step: its model, KV pool, attention backend and CUDA graphs, and
the forward of a step from its inputs.

The engine's runner (`runner.py`) plans steps and runs this forward; the other ranks of a
tensor-parallel engine (`parallel/executor.py`) run the same forward from the inputs rank 0
sends them, so every rank takes the same path (eager or the same CUDA-graph bucket) and
meets the others in the same collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.model.attention import AttentionMetadata, select_backend
from kvserve.workers.model.attention_torch import kernel_reads_kv
from kvserve.workers.model.layers.decoder import DecoderModel
from kvserve.workers.model.step_inputs import StepInputs, to_device

if TYPE_CHECKING:  # needs triton: imported only where graphs are used
    from kvserve.workers.model.cuda_graphs import StepGraphs

log = logging.getLogger(__name__)

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
    travel with its inputs and are applied by one scatter before its forward. `src` is the
    KV manager's `BlockTables`, or another rank's mirror of them (`parallel/tables.py`)."""

    def __init__(self, tables: Any, device: torch.device) -> None:
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


class StepForward:
    """Set up by `setup_device`; `forward_step` runs one step."""

    model: DecoderModel
    device: torch.device
    dtype: torch.dtype
    block_size: int

    def setup_device(self, cfg: ModelConfig, config: EngineConfig, tables: Any,
                     num_kv_heads: int, progress: Progress | None = None) -> None:
        """The attention backend, the KV pool (`num_kv_heads`: this rank's) and, on CUDA, the
        device block tables (read from `tables`) and the captured graphs."""
        on_cuda = self.device.type == "cuda"
        self.tables = DeviceTables(tables, self.device) if on_cuda else None
        # with 8-bit matmuls on the GGUF blocks, prompt rows attend one by one (a row's bits
        # then do not depend on its chunk; TorchAttention); float weights gain nothing from it
        step = getattr(self.model, "cpu_step", None)
        # auto: float16 K/V under 8-bit activations, where the C kernel reads them
        int8 = (step is not None and not step.exact and self.device.type == "cpu"
                and kernel_reads_kv(torch.float16, config.block_size, cfg.head_dim))
        self.kv_dtype = DTYPES[config.resolved_kv_cache_dtype(int8)]
        self.attn = select_backend(config.attention_backend, self.device, config.block_size, self.dtype,
                                   prefill_rows=step is not None and not step.exact,
                                   kv=(self.kv_dtype, cfg.head_dim))
        self.attn.configure(self.model.attention_layers)
        log.info("attention backend: %s", self.attn.name)
        use_graphs = on_cuda and not config.enforce_eager and self.attn.name == "triton"
        # what runs, said once at start-up and shown in GetServerInfo (WorkerInfo.runtime)
        self.runtime: dict[str, str] = {"attention": self.attn.name,
                                        "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch.")}
        if self.attn.name == "torch" and self.device.type == "cpu":
            from kvserve.workers.model.cpu_kernels import kernel_states

            rows = "prompt and decode rows" if getattr(self.attn, "prefill_rows", False) else "decode"
            self.runtime["attention"] = (f"torch, {rows} in the C kernel"
                                         if getattr(self.attn, "kernel", None) is not None else
                                         "torch, decode in SDPA: " + kernel_states().get(
                                             "paged_decode", "the kernel covers float32 only"))
        if on_cuda:
            if use_graphs:
                self.runtime["cuda_graphs"] = "on"
            elif config.enforce_eager:
                self.runtime["cuda_graphs"] = "off (enforce_eager)"
            else:
                why = (f"off: the {self.attn.name!r} attention backend is not captured in CUDA "
                       "graphs (only 'triton' is); every step runs eagerly")
                self.runtime["cuda_graphs"] = why
                log.warning("CUDA graphs %s", why)
        # with CUDA graphs, one block past the pool takes the padding rows' K/V writes
        self.cache = DeviceKVCache(
            cfg.num_layers, config.num_blocks + int(use_graphs), config.block_size,
            num_kv_heads, cfg.head_dim, self.kv_dtype, self.device,
        )
        self.graphs: StepGraphs | None = None
        if use_graphs:
            from kvserve.workers.model.cuda_graphs import StepGraphs

            assert self.tables is not None
            self.graphs = StepGraphs(self.model, self.cache, self.attn, config.max_num_seqs,
                                     self.tables.tensor, config.num_blocks,
                                     max_tokens=min(config.max_num_batched_tokens,
                                                    config.cuda_graph_max_tokens),
                                     extra=2 * tables.array.size + 2 * config.max_num_seqs,
                                     verify_tokens=_verify_tokens(config))
            log.info("capturing CUDA graphs: decode batches %s, %d mixed and %d verify buckets",
                     self.graphs.buckets, len(self.graphs.mixed), len(self.graphs.verify))
            self.graphs.capture(progress)

    def forward_step(self, step: StepInputs, block_tables: Sequence[Sequence[int]],
                     extras: list[np.ndarray], prev: DeviceTokens | None = None,
                     eager: bool = False) -> torch.Tensor:
        """Logits [S, vocab] of the step; `extras` (the block-table changes, then the rows
        of the ids still on the device) travel with its inputs in one copy. `eager`: no CUDA
        graph (a step with LoRA adapters)."""
        graphs = self.graphs
        if graphs is not None and not eager and graphs.tables is self._device_tables():
            key = graphs.key_for(step, sum(a.size for a in extras))
            if key is not None:
                views = graphs.stage(key, step, extras)
                self._apply(views, graphs.views(key)["ids"], prev)
                return graphs.run(step, key)
        meta = AttentionMetadata(
            query_lens=step.query_lens.tolist(), context_lens=step.context_lens.tolist(),
            block_tables=block_tables, slot_mapping=None,  # type: ignore[arg-type]
            block_size=self.block_size, inputs=step, device_tables=self._device_tables(),
        )
        dev = self.device
        extra = self.attn.host_plan(meta) if hasattr(self.attn, "host_plan") else []
        parts = [step.input_ids, step.positions, step.slot_mapping, step.logits_rows, *extra, *extras]
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


def _verify_tokens(config: EngineConfig) -> int:
    """The most tokens a step verifying proposals holds (every stream with a full proposal),
    within the step's token budget; 0 without speculation."""
    spec = config.speculative_config
    if spec is None:
        return 0
    return min(config.max_num_seqs * (spec.num_speculative_tokens + 1), config.max_num_batched_tokens)
