"""The host tier of a tensor-parallel engine: rank 0 keeps the table (block ids, hashes,
pins; `kvcache/host_cache.py`), and every block copy it makes, each other rank makes on its
own shard of the blocks with the same ids, in the same order (`ShardedCopier`). The ranks'
device and host pools are identical in block ids, so the KV manager, prefix cache and host
tier work unchanged. Blocks leaving or entering the engine whole (snapshots, prefix
records) are gathered from, or split among, the ranks' heads (`kv_heads.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.kvcache.transfer import BlockCopier, Transfer
from kvserve.workers.model.parallel.kv_heads import merge_heads, split_heads
from kvserve.workers.model.parallel.messages import pack, unpack

if TYPE_CHECKING:
    from kvserve.workers.model.parallel.ranks import ShardRanks


class ShardedCopier(BlockCopier):
    def __init__(self, ranks: ShardRanks, num_kv_heads: int, device_kv: torch.Tensor,
                 host_kv: torch.Tensor) -> None:
        super().__init__(device_kv, host_kv)
        self.ranks = ranks
        self.num_kv_heads = num_kv_heads  # the model's: what whole blocks hold

    # The other ranks copy synchronously on their compute stream, before any later step
    # they run: a device block is never reused before its copy there.
    def to_host_async(self, dev_ids: list[int], host_ids: list[int]) -> Transfer:
        if dev_ids:
            self.ranks.send(("to_host", list(dev_ids), list(host_ids)))
        return super().to_host_async(dev_ids, host_ids)

    def to_host(self, dev_ids: list[int], host_ids: list[int]) -> None:
        if dev_ids:
            self.ranks.send(("to_host", list(dev_ids), list(host_ids)))
        super().to_host(dev_ids, host_ids)

    def to_device(self, host_ids: list[int], dev_ids: list[int]) -> None:
        if host_ids:
            self.ranks.send(("to_device", list(host_ids), list(dev_ids)))
        super().to_device(host_ids, dev_ids)

    def read(self, host_ids: list[int]) -> torch.Tensor:
        """Host blocks with every KV head of the model."""
        ids = list(host_ids)
        self.ranks.send(("read", ids))
        mine = super().read(ids)
        parts = [unpack(reply[1]) for reply in self.ranks.replies("data")]
        return merge_heads([mine, *parts], self.num_kv_heads)

    def write(self, host_ids: list[int], data: torch.Tensor) -> None:
        """Fill host blocks from blocks with every KV head: each rank takes its heads."""
        ids, size = list(host_ids), self.ranks.size
        for r in range(1, size):
            self.ranks.send_to(r, ("write", ids, pack(split_heads(data, r, size))))
        super().write(ids, split_heads(data, 0, size))
