"""The live moves' block transports: a block read out of one pool and written into another is
the same KV, every layer's K and V, in the block-major wire layout, whether the ids form runs
or not; through the host tier's staging too (the tensor-parallel path), in several rounds when
the host pool is smaller than the move; on a GPU as well."""

from __future__ import annotations

import pytest
import torch

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.kvcache.host_cache import HostTier
from kvserve.kvcache.kv_transport import DirectTransport, HostStagedTransport, transport_for

L, BS, H, D = 3, 4, 2, 8
SRC = [3, 4, 5, 9, 2, 10, 11, 0]  # runs and single blocks
DST = [20, 21, 1, 2, 3, 7, 15, 16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def cache(device: str, seed: int) -> DeviceKVCache:
    c = DeviceKVCache(L, 24, BS, H, D, torch.float32, device)
    c.kv.copy_(torch.randn(c.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return c


@pytest.mark.parametrize("device", DEVICES)
def test_direct_transport_moves_whole_blocks(device):
    src, dst = cache(device, 1), cache(device, 2)
    data = DirectTransport(src).read(SRC)
    assert data.device.type == "cpu" and data.shape == (len(SRC), L, 2, BS, H, D)
    for i, b in enumerate(SRC):  # block-major: block i is every layer's K and V of SRC[i]
        assert torch.equal(data[i], src.kv[:, :, b].cpu())
    untouched = dst.kv[:, :, 0].clone()
    DirectTransport(dst).write(DST, data)
    for s, d in zip(SRC, DST, strict=True):
        assert torch.equal(dst.kv[:, :, d].cpu(), src.kv[:, :, s].cpu())
    assert torch.equal(dst.kv[:, :, 0], untouched)  # nothing else written


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host_blocks", [16, 3])  # 3: staged in several rounds
def test_host_staged_transport_moves_whole_blocks(device, host_blocks):
    src, dst = cache(device, 3), cache(device, 4)
    src_host, dst_host = HostTier(src.kv, host_blocks, BS), HostTier(dst.kv, host_blocks, BS)
    data = HostStagedTransport(src_host).read(SRC)
    assert torch.equal(data, DirectTransport(src).read(SRC))
    HostStagedTransport(dst_host).write(DST, data)
    for s, d in zip(SRC, DST, strict=True):
        assert torch.equal(dst.kv[:, :, d].cpu(), src.kv[:, :, s].cpu())
    # staging only: the host pools are as they were, every block free and uncached
    for h in (src_host, dst_host):
        assert h.num_used == 0 and h.num_cached() == 0
        h.close()


def test_transport_choice():
    c = cache("cpu", 5)
    assert isinstance(transport_for(c, None, sharded=False), DirectTransport)
    assert transport_for(c, None, sharded=True) is None  # sharded without a host tier
    h = HostTier(c.kv, 4, BS)
    assert isinstance(transport_for(c, h, sharded=True), HostStagedTransport)
    h.close()
