"""What a rank other than 0 runs: its shard of the model, KV pool and host pool, and the
forward of each step rank 0 sends (`StepForward`, as rank 0 runs it), with the host-tier
copies rank 0 makes, made on its own shard of the blocks."""

from __future__ import annotations

import torch

from kvserve.config import EngineConfig
from kvserve.kvcache.transfer import BlockCopier
from kvserve.workers.loading.loader import load_model
from kvserve.workers.loading.sharding import Shard, ShardLayout
from kvserve.workers.model.forward import DTYPES, StepForward
from kvserve.workers.model.layers.parallel import TensorParallel
from kvserve.workers.model.models.registry import build_model
from kvserve.workers.model.parallel.group import ParallelGroup
from kvserve.workers.model.parallel.messages import Packed, StepMessage, pack, unpack
from kvserve.workers.model.parallel.tables import TableMirror, TableRows
from kvserve.workers.model.runner import table_geometry


class ShardExecutor(StepForward):
    def __init__(self, path: str, config: EngineConfig, shard: Shard, group: ParallelGroup,
                 device: torch.device) -> None:
        self.device, self.dtype = device, DTYPES[config.resolved_dtype()]
        self.block_size = config.block_size
        loaded = load_model(path, self.dtype, shard)
        cfg = loaded.config
        layout = ShardLayout(cfg, shard)
        max_len = config.max_model_len or cfg.max_position_embeddings
        self.model = build_model(cfg, loaded.weights, device, self.dtype, max_len,
                                 quantized=loaded.quantized,
                                 quantized_decode=config.quantized_decode,
                                 cpu_matmul=config.cpu_matmul,
                                 tp=TensorParallel(layout, group))
        del loaded
        # rank 0's tables' shape (its device copy and CUDA graphs are sized by it); their
        # content arrives with the first step
        _, width = table_geometry(cfg, config)
        self.mirror = TableMirror(torch.zeros((config.max_num_seqs, width), dtype=torch.int32).numpy())
        self.setup_device(cfg, config, self.mirror, layout.num_kv_heads)
        self.copier: BlockCopier | None = None

    def start_host(self, num_blocks: int) -> None:
        if num_blocks < 1:
            return
        kv = self.cache.kv
        # block-major, as rank 0's host pool (kvcache/host_cache.py)
        host = torch.empty((num_blocks, kv.shape[0], kv.shape[1], *kv.shape[3:]), dtype=kv.dtype,
                           pin_memory=kv.is_cuda)
        self.copier = BlockCopier(kv, host)

    def step(self, msg: StepMessage) -> None:
        self.mirror.apply(msg.tables)
        step = msg.inputs(self.mirror.array)
        rows = TableRows(self.mirror.array, step.rows, step.context_lens + step.query_lens,
                         self.block_size)
        extras = list(self.tables.pending()) if self.tables is not None else []
        self.forward_step(step, rows, extras)

    # ---- host tier: rank 0's copies, on this rank's shard ------------------------------------
    def _host(self) -> BlockCopier:
        if self.copier is None:
            raise RuntimeError("a host-tier copy reached a rank without a host pool")
        return self.copier

    def to_host(self, dev_ids: list[int], host_ids: list[int]) -> None:
        self._host().to_host(dev_ids, host_ids)

    def to_device(self, host_ids: list[int], dev_ids: list[int]) -> None:
        self._host().to_device(host_ids, dev_ids)

    def read(self, host_ids: list[int]) -> Packed:
        return pack(self._host().read(host_ids))

    def write(self, host_ids: list[int], data: Packed) -> None:
        self._host().write(host_ids, unpack(data))
