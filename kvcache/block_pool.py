"""Reference-counted pool of fixed-size KV blocks with a content-addressed cache.

Free blocks stay in an LRU queue; a free block that still holds a full,
hashed prefix keeps its KV and can be revived by a later prefix hit until the
allocator reuses it. Blocks are handed out oldest-free first, so recently freed
prefixes survive longest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # hash -> block id, for full blocks whose KV is valid (in use or free-but-cached)
        self.cached: dict[int, int] = {}
        # free blocks in LRU order (front = evicted first); value unused
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # called with (block_id, hash) when a cached block's content is about to be overwritten
        self.on_evict: Callable[[int, int], None] | None = None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def is_free(self, block_id: int) -> bool:
        return self.ref_cnt[block_id] == 0

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take `n` free blocks (dropping any cached content they held).

        With `after` (a stream's last block), the block right behind it is taken
        when it is free and holds no cached prefix: a stream whose blocks stay
        consecutive is read as one view and moved as one slice.
        """
        if n > len(self.free_queue):
            raise RuntimeError(f"allocate({n}) with only {len(self.free_queue)} free blocks")
        out: list[int] = []
        prev = after
        for _ in range(n):
            nxt = None if prev is None else prev + 1
            if nxt is not None and nxt < self.num_blocks and nxt in self.free_queue \
                    and self.block_hash[nxt] is None:
                del self.free_queue[nxt]
                b = nxt
            else:
                b, _ = self.free_queue.popitem(last=False)
                self._drop_hash(b)
            self.ref_cnt[b] = 1
            out.append(b)
            prev = b
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference (a stream starts sharing a cached block)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop a reference; blocks reaching zero go to the back of the LRU queue."""
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def unallocate(self, block_ids: list[int]) -> None:
        """Return blocks taken by a rolled-back step to the front of the queue, in order."""
        for b in reversed(block_ids):
            self.release([b])
            self.free_queue.move_to_end(b, last=False)

    def reset_order(self) -> None:
        """Put an idle pool's free queue back in block-id order, as new (after a start-up
        probe used some blocks)."""
        if self.num_free != self.num_blocks or self.cached:
            raise RuntimeError("reset_order needs an idle pool with nothing cached")
        self.free_queue = OrderedDict((b, None) for b in range(self.num_blocks))

    def register(self, block_id: int, block_hash: int) -> None:
        """Record that `block_id` now holds the full block with `block_hash`."""
        if self.block_hash[block_id] is not None:
            return
        if block_hash in self.cached:
            return  # an identical block exists already; this one stays private
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def evict_cached(self) -> int:
        """Forget every free cached block's content (e.g. after a model reload)."""
        n = 0
        for b in self.free_queue:
            if self.block_hash[b] is not None:
                self._drop_hash(b)
                n += 1
        return n

    def _drop_hash(self, b: int) -> None:
        h = self.block_hash[b]
        if h is None:
            return
        if self.on_evict is not None:
            self.on_evict(b, h)
        self.block_hash[b] = None
        if self.cached.get(h) == b:
            del self.cached[h]

    def check_invariants(self) -> None:
        """Raise if the pool's bookkeeping is inconsistent (tests and debug builds)."""
        for b in range(self.num_blocks):
            in_free = b in self.free_queue
            if (self.ref_cnt[b] == 0) != in_free:
                raise AssertionError(f"block {b}: ref_cnt {self.ref_cnt[b]}, in free queue {in_free}")
            h = self.block_hash[b]
            if h is not None and self.cached.get(h) != b:
                raise AssertionError(f"block {b}: hash not indexed")
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                raise AssertionError(f"cache entry {h} -> {b} stale")
