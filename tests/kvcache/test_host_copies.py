"""Copies between the layer-major device pool and the block-major host pool: contents (every
layer's K and V of each block, runs and scattered ids), the device-side gather and scatter the
CUDA path uses, the start-up calibration, and, on a GPU, the ordering rules of the copies on
their side streams with no host synchronisation."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from kvserve.kvcache.host_cache import HostTier
from kvserve.kvcache.transfer import gather_blocks, runs, scatter_blocks

L, BS, H, D = 3, 4, 2, 8
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pools(device: str, n_dev: int = 24, n_host: int = 16) -> tuple[torch.Tensor, HostTier]:
    dev = torch.randn(L, 2, n_dev, BS, H, D, device=device)
    return dev, HostTier(dev, n_host, BS)


def block(dev: torch.Tensor, i: int) -> torch.Tensor:
    return dev[:, :, i].cpu()


# runs on both sides, a run only on one side, and single blocks
DEV_IDS = [3, 4, 5, 9, 2, 10, 11, 0]
HOST_IDS = [0, 1, 2, 7, 8, 4, 5, 15]


def test_runs():
    assert list(runs(DEV_IDS, HOST_IDS)) == [(0, 3, 0, 3), (3, 9, 7, 1), (4, 2, 8, 1),
                                              (5, 10, 4, 2), (7, 0, 15, 1)]
    assert list(runs([], [])) == []


def test_host_pool_is_block_major():
    dev, host = pools("cpu")
    assert host.kv.shape == (16, L, 2, BS, H, D)
    assert host.kv[5].is_contiguous() and host.kv[5].data_ptr() == host.kv.data_ptr() + 5 * host.bytes_per_block
    assert host.bytes_per_block == dev[:, :, 0].numel() * dev.element_size()


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_copies_move_every_layer_of_each_block(delay):
    dev, host = pools("cpu")
    want = {d: block(dev, d).clone() for d in DEV_IDS}
    host.copier.delay_s = delay  # > 0: the write-back runs later, on a worker thread
    t = host.copier.to_host_async(DEV_IDS, HOST_IDS)
    assert t.done() == (delay == 0)
    dst = [20, 21, 22, 23, 12, 13, 17, 6]
    host.copier.to_device(HOST_IDS, dst)  # waits for the write-back it reads
    assert t.done()
    for d, h, d2 in zip(DEV_IDS, HOST_IDS, dst, strict=True):
        assert torch.equal(host.kv[h], want[d])
        assert torch.equal(block(dev, d2), want[d])
    c = host.copier
    assert c.blocks["in"] == len(DEV_IDS) and c.bytes_copied == 2 * len(DEV_IDS) * host.bytes_per_block
    host.close()


def test_demotion_then_read_and_write():
    dev, host = pools("cpu")
    host.copier.to_host(DEV_IDS[:3], HOST_IDS[:3])
    data = host.copier.read(HOST_IDS[:3])  # block-major, as snapshots carry it
    assert data.shape == (3, L, 2, BS, H, D)
    assert torch.equal(data, torch.stack([block(dev, d) for d in DEV_IDS[:3]]))
    host.copier.write([9, 10, 11], data.flip(0))
    assert torch.equal(host.kv[9], block(dev, DEV_IDS[2])) and torch.equal(host.kv[11], block(dev, DEV_IDS[0]))


def test_gather_and_scatter_blocks():
    """The CUDA path's device-side gather into a block-major buffer and scatter back, here on
    CPU tensors: the same ops, the same layouts."""
    dev = torch.randn(L, 2, 12, BS, H, D)
    idx = torch.tensor([7, 2, 3, 11])
    out = torch.empty(4, L, 2, BS, H, D)
    gather_blocks(dev, idx, out)
    assert torch.equal(out, torch.stack([dev[:, :, i] for i in idx.tolist()]))
    target = torch.zeros_like(dev)
    scatter_blocks(target, torch.tensor([0, 5, 6, 9]), out)
    for j, i in zip([0, 5, 6, 9], idx.tolist(), strict=True):
        assert torch.equal(target[:, :, j], dev[:, :, i])
    assert target[:, :, [1, 2, 3, 4, 7, 8, 10, 11]].abs().sum() == 0


def test_calibration_measures_and_leaves_no_trace():
    dev, host = pools("cpu")
    before = dev.clone()
    host.cost.set_prefill(100, 1.0)
    host.calibrate(list(range(8)))
    c = host.cost
    assert c.measured and c.gbps("out") > 0 and c.gbps("in") > 0
    assert torch.equal(dev, before)  # blocks copied out and back into themselves
    assert host.table.num_free == host.num_blocks and not host.table.cached
    assert host.copier.bytes_copied == 0 and host.copier.blocks == {"out": 0, "in": 0}


# ---- CUDA: contents and ordering on the side streams -------------------------------------
def busy(stream: torch.cuda.Stream | None = None, ms: float = 200) -> None:
    """Keep a stream busy for a while (a GPU-side spin), so later work queues behind it."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        torch.cuda._sleep(int(ms * 1e6))  # about a nanosecond per cycle at ~1-2 GHz


class Held:
    """Holds a stream on the device until release(): cuStreamWaitValue32 on a pinned host word
    that release() sets, so what is queued behind it cannot have run, however fast the host or
    the GPU. A watchdog releases it after `limit_s`, so a host-side wait under test fails the
    test's assertions instead of hanging it."""

    def __init__(self, stream: torch.cuda.Stream, limit_s: float = 20.0) -> None:
        cu = ctypes.CDLL("libcuda.so.1")
        wait = getattr(cu, "cuStreamWaitValue32_v2", None) or cu.cuStreamWaitValue32
        wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self.word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        # CU_STREAM_WAIT_VALUE_GEQ (0); under unified addressing a pinned host address is
        # also its device address
        rc = wait(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(self.word.data_ptr()), 1, 0)
        assert rc == 0, f"cuStreamWaitValue32 failed with CUresult {rc}"
        self.timer = threading.Timer(limit_s, self.release)
        self.timer.start()

    def release(self) -> None:
        self.word[0] = 1
        self.timer.cancel()


@cuda
def test_cuda_write_back_waits_for_the_compute_stream_without_the_host():
    dev, host = pools("cuda")
    assert host.kv.is_pinned()
    host.copier.to_host_async(DEV_IDS, HOST_IDS).wait()  # buffers and pinned indices exist
    idx = torch.tensor(DEV_IDS, device="cuda")  # before the hold: a host-to-device copy waits
    torch.cuda.synchronize()
    held = Held(torch.cuda.current_stream())
    try:
        dev.index_fill_(2, idx, 7.0)  # written on the compute stream once it is released
        t = host.copier.to_host_async(DEV_IDS, HOST_IDS)
        # the host queued the copy and went on: the compute stream (and the copy behind it)
        # is still held
        assert not torch.cuda.current_stream().query() and not t.done()
    finally:
        held.release()
    t.wait()
    assert all(bool((host.kv[h] == 7.0).all()) for h in HOST_IDS)
    host.close()


@cuda
def test_cuda_restore_waits_for_the_write_back_of_its_blocks():
    dev, host = pools("cuda")
    want = {d: block(dev, d).clone() for d in DEV_IDS}
    busy(host.copier.streams["out"])  # the write-back below lands late
    host.copier.to_host_async(DEV_IDS, HOST_IDS)
    dst = [20, 21, 22, 23, 12, 13, 17, 6]
    host.copier.to_device(HOST_IDS, dst)
    torch.cuda.synchronize()
    for d, d2 in zip(DEV_IDS, dst, strict=True):
        assert torch.equal(block(dev, d2), want[d])
    assert host.copier.blocks == {"out": len(DEV_IDS), "in": len(DEV_IDS)}
    assert host.copier.seconds["out"] > 0 and host.copier.seconds["in"] > 0


@cuda
def test_cuda_write_back_never_overwrites_a_host_block_a_restore_still_reads():
    dev, host = pools("cuda")
    host.copier.to_host(DEV_IDS[:4], HOST_IDS[:4])
    torch.cuda.synchronize()
    old = {h: host.kv[h].clone() for h in HOST_IDS[:4]}
    busy(host.copier.streams["in"])  # the restore's loads run late
    host.copier.to_device(HOST_IDS[:4], [20, 21, 22, 23])
    host.copier.to_host_async([15, 16, 17, 18], HOST_IDS[:4])  # refills the same host blocks
    torch.cuda.synchronize()
    for h, d2 in zip(HOST_IDS[:4], [20, 21, 22, 23], strict=True):
        assert torch.equal(block(dev, d2), old[h])  # the restore read the old contents
    for h, d in zip(HOST_IDS[:4], [15, 16, 17, 18], strict=True):
        assert torch.equal(host.kv[h], block(dev, d))


@cuda
def test_cuda_demotion_is_copied_before_the_forward_overwrites_it():
    dev, host = pools("cuda")
    want = [block(dev, d).clone() for d in DEV_IDS[:3]]
    busy(host.copier.streams["out"])
    host.copier.to_host(DEV_IDS[:3], HOST_IDS[:3])
    dev[:, :, DEV_IDS[:3]] = 0.0  # the next forward reuses the blocks (compute stream)
    torch.cuda.synchronize()
    for h, w in zip(HOST_IDS[:3], want, strict=True):
        assert torch.equal(host.kv[h], w)


@cuda
def test_cuda_back_to_back_restores_share_the_buffer_safely():
    dev, host = pools("cuda")
    host.copier.to_host(DEV_IDS, HOST_IDS)
    torch.cuda.synchronize()
    busy()  # the first restore's scatter waits behind the spin on the compute stream
    host.copier.to_device(HOST_IDS[:4], [20, 21, 22, 23])
    host.copier.to_device(HOST_IDS[4:], [12, 13, 14, 19])  # its loads reuse the buffer
    torch.cuda.synchronize()
    for h, d2 in zip(HOST_IDS, [20, 21, 22, 23, 12, 13, 14, 19], strict=True):
        assert torch.equal(block(dev, d2), host.kv[h])
