"""The host tier: a second-level KV block pool in host memory.

The pool is block-major, [num_blocks, L, 2, bs, H, D] (pinned on CUDA): one host block,
every layer's K and V, is one contiguous span, so a block moves as one direct copy (see
`transfer.py`). One table, keyed by the same chained content hash as the device prefix cache, holds
both the blocks of evicted (parked) streams and blocks demoted from the device
when its LRU reuses them. A parked stream resuming and a follow-up turn of a
conversation are therefore the same lookup: a prefix hit served by copy.

Blocks are written back only when they leave the device, never per step, and a
hash already on host is not copied again. The table is a `BlockPool`: a parked
stream's blocks are referenced (pinned) and cannot be evicted; unreferenced
blocks keep their content and are evicted LRU when the pool needs space. A
parked stream's partial last block is kept as a private (unhashed) block.

Every copy that only pays off if the block later comes back by copy (a write-back, a
demotion, a restore) is made only where the restore cost model (`restore_cost.py`) finds the
copy cheaper than recomputing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.restore_cost import Choice, RestoreCost
from kvserve.kvcache.transfer import BlockCopier, Transfer

# blocks timed each way at start-up (the bandwidth figure), beside one block (the latency)
CALIBRATION_BLOCKS = 32

# The default host pool: this share of the RAM that is available when the engine starts,
# but never more than the cap, so several engines on one machine cannot exhaust it.
DEFAULT_HOST_FRACTION = 0.2
DEFAULT_HOST_CAP_GIB = 4.0


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError):
        return 4 << 30  # not Linux: assume a small machine


def default_host_bytes() -> int:
    return int(min(DEFAULT_HOST_FRACTION * available_ram_bytes(), DEFAULT_HOST_CAP_GIB * 2**30))


@dataclass
class ParkedKV:
    """What the host tier holds for one evicted stream."""

    num_tokens: int  # tokens whose KV was computed when the stream was evicted
    host_blocks: list[int] = field(default_factory=list)  # full blocks, in order, pinned
    tail_block: int | None = None  # the partial last block (private), pinned
    tail_tokens: int = 0  # tokens in tail_block
    transfer: Transfer | None = None
    choice: Choice | None = None  # why nothing was written back (the cost rule), if so

    @property
    def saved_tokens(self) -> int:
        """Tokens whose KV the host holds for this stream."""
        return len(self.host_blocks) * self.block_size + self.tail_tokens

    block_size: int = 16


class HostTier:
    def __init__(self, device_kv: torch.Tensor, num_blocks: int, block_size: int,
                 policy: str = "cost",
                 make_copier: Callable[[torch.Tensor, torch.Tensor], BlockCopier] | None = None,
                 ) -> None:
        """`policy`: how parked streams come back (`RestoreCost`); `make_copier(device_kv,
        host_kv)`: what moves the blocks (default `BlockCopier`; a tensor-parallel engine's
        also has every other rank copy its shard of them)."""
        if num_blocks < 1:
            raise ValueError("the host tier needs at least one block")
        self.block_size = block_size
        self.table = BlockPool(num_blocks)
        shape = (num_blocks, device_kv.shape[0], device_kv.shape[1], *device_kv.shape[3:])
        pin = device_kv.device.type == "cuda"
        # torch.empty: pages are only committed when a block is first written (on CPU)
        self.kv = torch.empty(shape, dtype=device_kv.dtype, pin_memory=pin)
        self.copier = (make_copier or BlockCopier)(device_kv, self.kv)
        self.bytes_per_block = self.kv[0].numel() * self.kv.element_size()
        self.cost = RestoreCost(self.bytes_per_block / block_size, policy)
        self.copier.cost = self.cost
        self.evictions = 0  # cached host blocks dropped to make room
        self.blocks_written = 0
        self.demotions_skipped = 0  # blocks not demoted: recomputing them is cheaper
        self.table.on_evict = self._on_evict

    def _on_evict(self, block_id: int, block_hash: int) -> None:
        self.evictions += 1

    @property
    def num_blocks(self) -> int:
        return self.table.num_blocks

    @property
    def num_used(self) -> int:
        return self.table.num_used

    def num_cached(self) -> int:
        return len(self.table.cached)

    def lookup(self, block_hash: int) -> int | None:
        return self.table.lookup(block_hash)

    def pin(self, host_ids: list[int]) -> None:
        self.table.touch(host_ids)

    def unpin(self, host_ids: list[int]) -> None:
        self.table.release(host_ids)

    # ---- write-back ------------------------------------------------------------------------
    def park(self, dev_blocks: list[int], hashes: list[int], num_tokens: int) -> ParkedKV:
        """Write an evicted stream's blocks to host and pin them.

        `hashes` are its full blocks' chained hashes; blocks already on host are pinned,
        not copied. When the pool runs out of evictable blocks the chain stops there:
        the stream recomputes exactly the part that was not saved.
        """
        parked = ParkedKV(num_tokens, block_size=self.block_size)
        src: list[int] = []
        dst: list[int] = []
        for dev, h in zip(dev_blocks, hashes, strict=False):
            hb = self.table.lookup(h)
            if hb is None:
                if self.table.num_free == 0:
                    break
                hb = self.table.allocate(1, after=dst[-1] if dst else None)[0]  # runs copy as one slice
                self.table.register(hb, h)
                src.append(dev)
                dst.append(hb)
            else:
                self.table.touch([hb])
            parked.host_blocks.append(hb)
        n_full = num_tokens // self.block_size
        if (num_tokens % self.block_size and len(parked.host_blocks) == n_full == len(hashes)
                and self.table.num_free > 0 and len(dev_blocks) > n_full):
            tb = self.table.allocate(1, after=dst[-1] if dst else None)[0]
            src.append(dev_blocks[n_full])
            dst.append(tb)
            parked.tail_block = tb
            parked.tail_tokens = num_tokens % self.block_size
        try:
            parked.transfer = self.copier.to_host_async(src, dst)
        except BaseException:
            self.release(parked, forget=dst)
            raise
        self.blocks_written += len(src)
        return parked

    def demote(self, pairs: list[tuple[int, int]]) -> int:
        """Save device blocks (device id, hash) that are about to be reused; returns blocks copied.

        Hashes already on host are skipped; with no evictable host block left the rest
        is dropped (the device prefix cache would have dropped it anyway). Nothing is saved
        where copying it out and back would cost more than recomputing it.
        """
        if not self.cost.choose(len(pairs) * self.block_size, round_trip=True).copy:
            self.demotions_skipped += len(pairs)
            return 0
        src: list[int] = []
        dst: list[int] = []
        hashes: list[int] = []
        seen: set[int] = set()
        for dev, h in pairs:
            if h in seen:
                continue
            seen.add(h)
            hb = self.table.lookup(h)
            if hb is not None:
                if self.table.is_free(hb):
                    self.table.free_queue.move_to_end(hb)  # recently used: keep it longest
                continue
            if self.table.num_free == 0:
                break
            hb = self.table.allocate(1, after=dst[-1] if dst else None)[0]  # runs copy as one slice
            src.append(dev)
            dst.append(hb)
            hashes.append(h)
        try:
            self.copier.to_host(src, dst)
        except BaseException:
            self.table.unallocate(dst)
            raise
        # indexed only once the content is there: a failed copy publishes nothing
        for hb, h in zip(dst, hashes, strict=True):
            self.table.register(hb, h)
        self.table.release(dst)
        self.blocks_written += len(src)
        return len(src)

    def adopt(self, data: torch.Tensor, hashes: list[int], num_tokens: int) -> ParkedKV:
        """Take in a stream's KV from elsewhere (a snapshot): `data` is [n, L, 2, bs, H, D] with
        its full blocks (`hashes`) then, if num_tokens is not a block multiple, its tail.
        Blocks already on host are pinned, not written; what does not fit is recomputed."""
        parked = ParkedKV(num_tokens, block_size=self.block_size)
        idx: list[int] = []
        dst: list[int] = []
        new_hashes: list[int] = []
        for i, h in enumerate(hashes):
            hb = self.table.lookup(h)
            if hb is None:
                if self.table.num_free == 0:
                    break
                hb = self.table.allocate(1, after=dst[-1] if dst else None)[0]  # runs copy as one slice
                idx.append(i)
                dst.append(hb)
                new_hashes.append(h)
            else:
                self.table.touch([hb])
            parked.host_blocks.append(hb)
        tail_tokens = num_tokens % self.block_size
        if (tail_tokens and len(parked.host_blocks) == len(hashes) and data.shape[0] > len(hashes)
                and self.table.num_free > 0):
            parked.tail_block = self.table.allocate(1, after=dst[-1] if dst else None)[0]
            parked.tail_tokens = tail_tokens
            idx.append(len(hashes))
            dst.append(parked.tail_block)
        try:
            if idx:
                self.copier.write(dst, data.index_select(0, torch.tensor(idx, dtype=torch.long)))
        except BaseException:
            self.release(parked)
            raise
        for hb, h in zip(dst, new_hashes, strict=False):
            self.table.register(hb, h)
        self.blocks_written += len(dst)
        return parked

    def read(self, parked: ParkedKV) -> torch.Tensor:
        """A parked stream's saved blocks (full ones, then the tail) as one block-major host
        tensor [n, L, 2, bs, H, D]."""
        ids = parked.host_blocks + ([parked.tail_block] if parked.tail_block is not None else [])
        if parked.transfer is not None:
            parked.transfer.wait()
        return self.copier.read(ids)

    # ---- restore ---------------------------------------------------------------------------
    def restore(self, host_ids: list[int], dev_ids: list[int]) -> None:
        """Copy host blocks into (freshly allocated) device blocks, before the forward."""
        self.copier.to_device(host_ids, dev_ids)

    def calibrate(self, dev_ids: list[int]) -> None:
        """Time copies of one block and of `dev_ids` (free device blocks) each way through
        the real path, at start-up: the cost model's bandwidth and latency per direction.
        The copies' figures are not counted in the tier's own."""
        k = min(len(dev_ids), self.table.num_free, CALIBRATION_BLOCKS)
        if k < 1:
            return
        dev = dev_ids[:k]
        host = self.table.allocate(k)
        try:
            for direction in ("out", "in"):
                self.copier.timed_round(direction, dev, host)  # warm-up: first calls set things up
                one = min(self.copier.timed_round(direction, dev[:1], host[:1]) for _ in range(3))
                if k == 1:
                    self.cost.set_copy(direction, one / self.bytes_per_block, 0.0)
                    continue
                many = min(self.copier.timed_round(direction, dev, host) for _ in range(3))
                per_byte = (many - one) / ((k - 1) * self.bytes_per_block)
                if per_byte <= 0:  # noise: no latency to tell apart
                    self.cost.set_copy(direction, many / (k * self.bytes_per_block), 0.0)
                else:
                    self.cost.set_copy(direction, per_byte, one - per_byte * self.bytes_per_block)
        finally:
            self.table.unallocate(host)
            self.copier.reset_figures()

    def release(self, parked: ParkedKV, forget: list[int] | None = None) -> None:
        """Drop a parked stream's pins (restored, aborted or exported).

        Its full blocks stay cached until LRU eviction; the private tail is free at once.
        `forget` lists blocks whose copy failed: their hashes are dropped first.
        """
        if parked.transfer is not None:
            try:
                parked.transfer.wait()
            except Exception:
                forget = list(parked.host_blocks) + (
                    [parked.tail_block] if parked.tail_block is not None else [])
        for hb in forget or []:
            self.table._drop_hash(hb)
        self.table.release(reversed(parked.host_blocks))
        if parked.tail_block is not None:
            self.table.release([parked.tail_block])
        parked.host_blocks = []
        parked.tail_block = None
        parked.tail_tokens = 0
        parked.transfer = None

    def reset(self) -> None:
        """Forget every unpinned cached block (model reload)."""
        self.table.evict_cached()

    def check_invariants(self, pinned: list[ParkedKV]) -> None:
        self.table.check_invariants()
        refs = [0] * self.num_blocks
        for p in pinned:
            for hb in p.host_blocks:
                refs[hb] += 1
            if p.tail_block is not None:
                refs[p.tail_block] += 1
        if refs != self.table.ref_cnt:
            raise AssertionError("host block pins do not match the parked streams")

    def close(self) -> None:
        self.copier.close()
