"""The device tier's KV storage: one tensor for all layers, paged in blocks.

Layout: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim].
Per layer, K and V are each one contiguous [num_blocks * block_size, H, D]
array, so a token's slot is `block_id * block_size + offset` and a stream
whose blocks are consecutive reads its KV as a zero-copy view. Moving whole
blocks is one `index_select` over the block dimension for all layers at once;
the host tier keeps its blocks block-major instead (`transfer.py`).
"""

from __future__ import annotations

import torch


class DeviceKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )

    @property
    def bytes_per_block(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [num_blocks, block_size, H, D] views."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, H, D]) at flat slot indices ([T]), in the cache's
        dtype (a float16 cache under a float32 model rounds them to nearest even)."""
        kc, vc = self.layer(layer)
        if k.dtype != kc.dtype:
            k, v = k.to(kc.dtype), v.to(kc.dtype)
        kc.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
        vc.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy out whole blocks of every layer: [num_layers, 2, n, block_size, H, D]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        return self.kv.index_select(2, idx)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Copy whole blocks back in (the inverse of read_blocks)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(2, idx, data.to(self.kv.device, self.kv.dtype))
