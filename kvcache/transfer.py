"""Block copies between the device pool and the host pool, and their ordering.

Every copy moves a list of whole blocks (all layers, K and V) with one
`index_select` and one `index_copy_`, so a stream moves in one large copy.

Ordering rules (what makes the tier safe):
- A write-back of an evicted stream (device -> host) may run asynchronously: on
  CUDA on a side stream that first waits for the compute stream (the KV it reads
  was written there), recording an event; on CPU on a worker thread when a copy
  delay is injected (tests), else synchronously. Its `Transfer` says when it is
  done; the caller keeps the source device blocks referenced until then, so the
  allocator can never hand out a block whose copy is still in flight.
- Demotions (device -> host right before a block is reused) and restores
  (host -> device) run on the compute stream, in order with the forward pass
  that follows. A restore first waits for every in-flight write-back, so it
  never reads a host block that is still being filled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Transfer:
    """One asynchronous device -> host copy; `finish` runs once, after the data arrived."""

    def __init__(self, nbytes: int, event: torch.cuda.Event | None = None,
                 future: Future[None] | None = None,
                 finish: Callable[[], None] | None = None) -> None:
        self.nbytes = nbytes
        self.event = event
        self.future = future
        self._finish = finish

    def done(self) -> bool:
        if self.future is not None and not self.future.done():
            return False
        if self.event is not None and not self.event.query():
            return False
        return True

    def wait(self) -> None:
        """Block until the copy has completed; re-raises a failed copy's error."""
        if self.future is not None:
            self.future.result()
        if self.event is not None:
            self.event.synchronize()
        if self._finish is not None:
            fn, self._finish = self._finish, None
            fn()


class BlockCopier:
    def __init__(self, device_kv: torch.Tensor, host_kv: torch.Tensor) -> None:
        self.dev = device_kv
        self.host = host_kv
        self.cuda = device_kv.device.type == "cuda"
        self.side = torch.cuda.Stream(device_kv.device) if self.cuda else None
        # tests: sleep this long inside every asynchronous write-back before it reads the device
        self.delay_s = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: list[Transfer] = []
        self._lock = threading.Lock()
        self.bytes_copied = 0
        self.copy_s = 0.0  # time of the timed copies (bandwidth figure)
        self.timed_bytes = 0
        # CPU: wall time of the synchronous copies; CUDA: CUDA-event time of every copy
        self._seconds = {"out": 0.0, "in": 0.0}  # device->host / host->device
        self._blocks = {"out": 0, "in": 0}
        # CUDA copies whose events have not been read yet: (start, end, blocks, direction)
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event, int, str]] = []

    def _nbytes(self, n: int) -> int:
        return n * self.dev[:, :, 0].numel() * self.dev.element_size()

    # ---- device -> host ------------------------------------------------------------------
    def to_host_async(self, dev_ids: list[int], host_ids: list[int]) -> Transfer:
        if not dev_ids:
            return Transfer(0)
        nbytes = self._nbytes(len(dev_ids))
        if self.cuda:
            assert self.side is not None
            t = self._cuda_copy_out(dev_ids, host_ids, nbytes)
        elif self.delay_s > 0:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-writeback")
            t = Transfer(nbytes, future=self._pool.submit(self._delayed_copy, dev_ids, host_ids))
        else:
            self.to_host(dev_ids, host_ids)
            return Transfer(0)
        self.bytes_copied += nbytes  # CPU: not timed (bandwidth counts the synchronous copies)
        with self._lock:
            # finish completed copies in issue order only: a later copy into a reused host
            # block must land after an earlier one into the same block
            k = 0
            while k < len(self._inflight) and self._inflight[k].done():
                k += 1
            done, self._inflight = self._inflight[:k], self._inflight[k:] + [t]
        for x in done:
            x.wait()  # runs its finish step
        return t

    def _cuda_copy_out(self, dev_ids: list[int], host_ids: list[int], nbytes: int) -> Transfer:
        # side stream after the compute stream (it reads KV the forward wrote), into a
        # pinned staging buffer; the scatter into the host pool runs once the event fired.
        # The host never waits here: no synchronisation in the step.
        assert self.side is not None
        start, ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.side.wait_stream(torch.cuda.current_stream(self.dev.device))
        shape = (*self.dev.shape[:2], len(dev_ids), *self.dev.shape[3:])
        # allocated before the timed region: a new pinned allocation is a host call that the
        # side stream would otherwise sit idle through, inside the copy's event time
        staging = torch.empty(shape, dtype=self.dev.dtype, pin_memory=True)
        with torch.cuda.stream(self.side):
            didx = torch.tensor(dev_ids, dtype=torch.long).to(self.dev.device, non_blocking=True)
            start.record(self.side)
            data = self.dev.index_select(2, didx)
            staging.copy_(data, non_blocking=True)
            ev.record(self.side)
        with self._lock:
            self._timing.append((start, ev, len(dev_ids), "out"))
        hidx = torch.tensor(host_ids, dtype=torch.long)
        return Transfer(nbytes, event=ev, finish=lambda: self.host.index_copy_(2, hidx, staging))

    def _delayed_copy(self, dev_ids: list[int], host_ids: list[int]) -> None:
        time.sleep(self.delay_s)
        self._copy_out(dev_ids, host_ids)

    def to_host(self, dev_ids: list[int], host_ids: list[int]) -> None:
        """Copy before anything later on the compute stream runs (demotion of blocks that
        the coming forward overwrites)."""
        if not dev_ids:
            return
        if self.cuda:
            t = self._cuda_copy_out(dev_ids, host_ids, self._nbytes(len(dev_ids)))
            assert t.event is not None
            # the compute stream waits for the copy on the device; the host does not
            torch.cuda.current_stream(self.dev.device).wait_event(t.event)
            with self._lock:
                self._inflight.append(t)
            self.bytes_copied += self._nbytes(len(dev_ids))
            return
        t0 = time.perf_counter()
        self._copy_out(dev_ids, host_ids)
        self._timed(t0, len(dev_ids), "out")

    def _copy_out(self, dev_ids: list[int], host_ids: list[int]) -> None:
        copy_runs(self.host, host_ids, self.dev, dev_ids)

    # ---- host -> device ------------------------------------------------------------------
    def to_device(self, host_ids: list[int], dev_ids: list[int]) -> None:
        if not host_ids:
            return
        self.wait_all()
        if self.cuda:
            # gather straight into pinned memory, then one non-blocking copy on the compute
            # stream (the forward that follows reads these blocks)
            hidx = torch.tensor(host_ids, dtype=torch.long)
            shape = (*self.host.shape[:2], len(host_ids), *self.host.shape[3:])
            staging = torch.empty(shape, dtype=self.host.dtype, pin_memory=True)
            torch.index_select(self.host, 2, hidx, out=staging)
            stream = torch.cuda.current_stream(self.dev.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            data = staging.to(self.dev.device, non_blocking=True)
            didx = torch.tensor(dev_ids, dtype=torch.long).to(self.dev.device, non_blocking=True)
            self.dev.index_copy_(2, didx, data)
            end.record(stream)
            with self._lock:
                self._timing.append((start, end, len(host_ids), "in"))
            self.bytes_copied += self._nbytes(len(host_ids))
            return
        t0 = time.perf_counter()
        copy_runs(self.dev, dev_ids, self.host, host_ids)
        self._timed(t0, len(host_ids), "in")

    def wait_all(self) -> None:
        with self._lock:
            pending, self._inflight = self._inflight, []
        for t in pending:
            t.wait()

    def read(self, host_ids: list[int]) -> torch.Tensor:
        """Host blocks as one tensor [L, 2, n, bs, H, D] (snapshot export)."""
        self.wait_all()
        if self.cuda:
            torch.cuda.current_stream(self.dev.device).synchronize()
        return self.host.index_select(2, torch.tensor(host_ids, dtype=torch.long))

    def write(self, host_ids: list[int], data: torch.Tensor) -> None:
        """Fill host blocks from a tensor (snapshot import)."""
        self.wait_all()
        self.host.index_copy_(2, torch.tensor(host_ids, dtype=torch.long), data.to(self.host.dtype))

    def _timed(self, t0: float, n: int, direction: str) -> None:
        dt = time.perf_counter() - t0
        self.copy_s += dt
        self.bytes_copied += self._nbytes(n)
        self.timed_bytes += self._nbytes(n)
        self._seconds[direction] += dt
        self._blocks[direction] += n

    def settle(self, block: bool = False) -> None:
        """Fold finished CUDA copies' event times into the figures (all of them, waiting for
        the events, when `block`); reporting only, never called in a step."""
        with self._lock:
            pending, self._timing = self._timing, []
        keep = []
        for start, end, n, direction in pending:
            if not block and not end.query():
                keep.append((start, end, n, direction))
                continue
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
            self.copy_s += dt
            self.timed_bytes += self._nbytes(n)
            self._seconds[direction] += dt
            self._blocks[direction] += n
        with self._lock:
            self._timing = keep + self._timing

    @property
    def seconds(self) -> dict[str, float]:
        self.settle(block=True)
        return self._seconds

    @property
    def blocks(self) -> dict[str, int]:
        self.settle(block=True)
        return self._blocks

    def gbps(self) -> float:
        self.settle()
        return self.timed_bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    def close(self) -> None:
        self.wait_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def copy_runs(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids] on CPU, one slice copy per run of ids that are
    consecutive on both sides (several times faster than index_select + index_copy_, which
    go element by element over the [L, 2] outer dimensions)."""
    i, n = 0, len(dst_ids)
    while i < n:
        j = i + 1
        while j < n and dst_ids[j] == dst_ids[j - 1] + 1 and src_ids[j] == src_ids[j - 1] + 1:
            j += 1
        d, s = dst_ids[i], src_ids[i]
        dst[:, :, d : d + j - i].copy_(src[:, :, s : s + j - i])
        i = j
