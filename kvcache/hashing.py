"""Chained content hashes of full KV blocks.

A block's hash covers its own tokens and, through the parent hash, every token
before it; equal hashes therefore mean an equal prefix, so the block's KV can be
shared. blake2b keeps the value stable across processes (the router compares
hashes reported by different workers) and makes accidental collisions negligible.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b

ROOT_HASH = 0


def hash_block(parent: int, tokens: list[int] | tuple[int, ...]) -> int:
    h = blake2b(parent.to_bytes(8, "little", signed=False), digest_size=8)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_full_blocks(
    token_ids: list[int], block_size: int, start_block: int = 0, parent: int = ROOT_HASH
) -> list[int]:
    """Hashes of the full blocks from `start_block` on, chained from `parent`."""
    out: list[int] = []
    n_full = len(token_ids) // block_size
    for b in range(start_block, n_full):
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size])
        out.append(parent)
    return out
