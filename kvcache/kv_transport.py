"""Moving whole KV blocks out of one engine's device pool and into another's.

A live move (workers/engine/live_move.py) ships a running stream's blocks between workers in
one wire format, whatever the engines: block-major host tensors [n, L, 2, bs, H, D] holding
every KV head of the model (the host tier's and the snapshots' layout), so engines of
different tensor-parallel sizes exchange them as they exchange snapshots. The bytes go
worker to worker through Ray's object store.

Two transports:
- `DirectTransport` (one device holds all heads): the blocks are gathered from the device
  pool into one host tensor (on CUDA: device -> host, pinned) and scattered back on the other
  side. Runs of consecutive blocks are one slice each.
- `HostStagedTransport` (a tensor-parallel engine: each rank holds its share of the heads):
  through the host tier's copier, which has every rank copy its shard, and gathers or
  splits the heads on the host. Host blocks serve as a staging buffer only (taken and given
  back within the call); it needs a host tier.

Both are called on the engine's step thread between steps, like the host tier's copies, so
the device pool is never read while a step writes the same blocks. A transport for a direct
device-to-device path (NCCL, NIXL) would implement the same two calls.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.kvcache.host_cache import HostTier
from kvserve.kvcache.transfer import gather_blocks, runs, scatter_blocks


class KVTransport(Protocol):
    name: str

    def read(self, dev_ids: list[int]) -> torch.Tensor:
        """Device blocks as one block-major host tensor [n, L, 2, bs, H, D], all heads."""
        ...

    def write(self, dev_ids: list[int], data: torch.Tensor) -> None:
        """The inverse of `read` on the receiving engine."""
        ...


class DirectTransport:
    name = "direct"

    def __init__(self, cache: DeviceKVCache) -> None:
        self.kv = cache.kv  # [L, 2, NB, bs, H, D]
        self.cuda = self.kv.device.type == "cuda"

    def read(self, dev_ids: list[int]) -> torch.Tensor:
        n = len(dev_ids)
        shape = (n, self.kv.shape[0], self.kv.shape[1], *self.kv.shape[3:])
        if self.cuda:  # one gather on the device, one copy into pinned memory
            idx = torch.tensor(dev_ids, dtype=torch.long, device=self.kv.device)
            buf = torch.empty(shape, dtype=self.kv.dtype, device=self.kv.device)
            gather_blocks(self.kv, idx, buf)
            out = torch.empty(shape, dtype=self.kv.dtype, pin_memory=True)
            out.copy_(buf, non_blocking=True)
            torch.cuda.current_stream(self.kv.device).synchronize()
            return out
        out = torch.empty(shape, dtype=self.kv.dtype)
        for i, _, d, k in runs(list(range(n)), dev_ids):
            out[i : i + k].copy_(self.kv[:, :, d : d + k].movedim(2, 0))  # one copy per run
        return out

    def write(self, dev_ids: list[int], data: torch.Tensor) -> None:
        if self.cuda:
            idx = torch.tensor(dev_ids, dtype=torch.long, device=self.kv.device)
            scatter_blocks(self.kv, idx, data.to(self.kv.device, self.kv.dtype))
            return
        data = data.to(self.kv.dtype)
        for i, _, d, k in runs(list(range(len(dev_ids))), dev_ids):
            self.kv[:, :, d : d + k].movedim(2, 0).copy_(data[i : i + k])


class HostStagedTransport:
    name = "host-staged"

    def __init__(self, host: HostTier) -> None:
        self.host = host

    def _stage(self, n: int) -> list[list[int]]:
        """Host blocks to stage `n` device blocks through, in rounds the pool can hold."""
        free = self.host.table.num_free
        if free < 1:
            raise RuntimeError("the host tier has no free block to stage a live move through")
        return [list(range(i, min(n, i + free))) for i in range(0, n, free)]

    def read(self, dev_ids: list[int]) -> torch.Tensor:
        parts = []
        for chunk in self._stage(len(dev_ids)):
            ids = self.host.table.allocate(len(chunk))
            try:
                self.host.copier.to_host([dev_ids[i] for i in chunk], ids)
                parts.append(self.host.copier.read(ids))
            finally:
                self.host.table.unallocate(ids)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def write(self, dev_ids: list[int], data: torch.Tensor) -> None:
        for chunk in self._stage(len(dev_ids)):
            ids = self.host.table.allocate(len(chunk))
            try:
                self.host.copier.write(ids, data[chunk[0] : chunk[-1] + 1])
                self.host.copier.to_device(ids, [dev_ids[i] for i in chunk])
                self.host.copier.wait_all()
            finally:
                self.host.table.unallocate(ids)


def transport_for(cache: DeviceKVCache, host: HostTier | None, sharded: bool) -> KVTransport | None:
    """The engine's transport; None where live moves cannot run (sharded, no host tier)."""
    if not sharded:
        return DirectTransport(cache)
    return HostStagedTransport(host) if host is not None else None
