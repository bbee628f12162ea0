"""The ranks of one engine as a torch.distributed process group, and its collectives.

The group is built directly on a TCPStore that rank 0 hosts (not through
`init_process_group`), so several engines, tensor-parallel or not, live side by side in one
process. NCCL on CUDA (its collectives are captured inside CUDA graphs), gloo on the CPU,
where a rank that dies closes its sockets and the others' next collective raises at once.
On the CPU each collective's wall time is summed (`seconds`): the cost the ranks pay to
agree, the figure `kvserve bench tp` reports per step.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

STORE_HOST = "127.0.0.1"  # the ranks of a worker share one node


class ParallelGroup:
    def __init__(self, pg: Any, rank: int, size: int, device: torch.device) -> None:
        self.pg, self.rank, self.size, self.device = pg, rank, size, device
        self.timed = device.type == "cpu"  # on CUDA a host clock would time the launch only
        self.seconds = 0.0  # in collectives (CPU)
        self.calls = 0
        self.bytes = 0  # payload handed to collectives by this rank

    @staticmethod
    def host_store(size: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's store, on a free port the other ranks are told."""
        return dist.TCPStore(STORE_HOST, 0, size, True, timeout=_delta(timeout_s),
                             wait_for_workers=False)

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int, device: torch.device,
             timeout_s: float) -> ParallelGroup:
        """Connect to the other ranks (blocks until all of them have)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _delta(timeout_s)
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            # one gloo worker thread, on loopback: a step's collectives run one after another,
            # and on the 2-core host a 2 KiB all-reduce takes 0.5 ms so against 2 ms with
            # gloo's default of 2 threads (handing each call between them costs wake-ups)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _delta(timeout_s)
            opts._threads = 1
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=STORE_HOST)]
            pg = dist.ProcessGroupGloo(store, rank, size, opts)
        return cls(pg, rank, size, device)

    @classmethod
    def connect(cls, port: int, rank: int, size: int, device: torch.device,
                timeout_s: float) -> ParallelGroup:
        store = dist.TCPStore(STORE_HOST, port, size, False, timeout=_delta(timeout_s))
        return cls.join(store, rank, size, device, timeout_s)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place."""
        if not self.timed:
            self.pg.allreduce([t]).wait()
            return t
        t0 = time.perf_counter()
        self.pg.allreduce([t]).wait()
        self._count(t0, t)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[size * rows, ...]: every rank's `t` ([rows, ...]) in rank order."""
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        t0 = time.perf_counter() if self.timed else 0.0
        self.pg._allgather_base(out, t.contiguous()).wait()
        if self.timed:
            self._count(t0, t)
        return out

    def _count(self, t0: float, t: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += t.numel() * t.element_size()

    def abort(self) -> None:
        """Make collectives under way fail (a rank died: NCCL would wait for it forever)."""
        abort = getattr(self.pg, "abort", None)
        if abort is not None:
            abort()


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
