"""Whole KV heads from the ranks' shards of KV blocks, and back (snapshots, prefix records).

Blocks leave an engine with all of the model's KV heads in order (block-major, `[n, L, 2, bs, H, D]`),
whatever its tensor-parallel size, so a stream moves between workers of different sizes of
the same model. Rank r holds KV heads `ShardLayout.kv_heads`; a head replicated on several
ranks (fewer KV heads than ranks) is taken from the first of them.
"""

from __future__ import annotations

import torch

from kvserve.workers.loading.sharding import kv_head_ranks

HEAD_DIM = 4  # the head axis of a block tensor [n, L, 2, bs, H, D]


def merge_heads(parts: list[torch.Tensor], num_kv_heads: int) -> torch.Tensor:
    """Every rank's blocks (`parts[r]`, its heads) -> the blocks with all heads in order."""
    size = len(parts)
    if num_kv_heads < size:
        return torch.cat([parts[r] for r in kv_head_ranks(num_kv_heads, size)], dim=HEAD_DIM)
    return torch.cat(parts, dim=HEAD_DIM)


def split_heads(whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s heads of blocks that hold every head."""
    heads = whole.shape[HEAD_DIM]
    if heads < size:
        h = rank // (size // heads)
        return whole.narrow(HEAD_DIM, h, 1)
    per = heads // size
    return whole.narrow(HEAD_DIM, rank * per, per)
