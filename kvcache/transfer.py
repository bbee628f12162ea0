"""Block copies between the device pool and the host pool, and their ordering.

The device pool is layer-major, [L, 2, N, bs, H, D] (the attention kernels read a layer's K
or V as one array of slots); the host pool is block-major, [NB, L, 2, bs, H, D], so a host
block (every layer, K and V) is one contiguous span and a run of consecutive host blocks is
one larger span.

- CPU: both pools are host memory. A copy is one strided slice copy per run of block ids
  that are consecutive on both sides (`copy_out_runs`, `copy_in_runs`).
- CUDA, device -> host (write-back of an evicted stream, demotion): on the `out` side stream
  one `index_select` gathers the blocks into a block-major device buffer (device bandwidth),
  then one non-blocking copy per run of consecutive host ids writes straight into the pinned
  host pool. No staging copy, no CPU-side scatter, no host synchronisation.
- CUDA, host -> device (restore, host prefix hit): on the `in` side stream one non-blocking
  copy per run of consecutive host ids loads the pinned blocks into a block-major device
  buffer; the compute stream waits for its event (the host does not) and scatters the buffer
  into the pool with one `index_copy_` before the forward. Under asynchronous scheduling a
  step is launched while the one before still runs, so its restores load during that step.
- The device buffers are grow-only, one per direction, as large as the largest copy so far.

Ordering rules (what makes the tier safe):
- A write-back reads KV the forward wrote: the out stream first waits for the compute stream.
  Its `Transfer` says when it is done; the caller keeps the source device blocks referenced
  until then, so the allocator never hands out a block whose copy is in flight.
- A demotion reads blocks the coming forward overwrites: the compute stream waits for its
  event (on CPU it is synchronous).
- A restore never reads a host block still being filled: on CUDA its loads wait for the
  events of the write-backs into those blocks; on CPU it waits for every write-back in flight
  (asynchronous there only in tests, where a copy delay runs it on a worker thread).
- A host block is never refilled while a restore still reads it: a write-back into it waits
  for that restore's load event; the next restore's loads wait until the compute stream has
  scattered the buffer they overwrite.
- Whoever reads or writes the host pool on the CPU (snapshots) first waits for every copy in
  flight that touches it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvserve.kvcache.restore_cost import RestoreCost


class Transfer:
    """One asynchronous device -> host copy into the host blocks `blocks`."""

    def __init__(self, nbytes: int, event: torch.cuda.Event | None = None,
                 future: Future[None] | None = None,
                 finish: Callable[[], None] | None = None,
                 blocks: frozenset[int] = frozenset()) -> None:
        self.nbytes = nbytes
        self.event = event
        self.future = future
        self._finish = finish
        self.blocks = blocks

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


def runs(a: list[int], b: list[int]) -> Iterator[tuple[int, int, int, int]]:
    """(position, a[position], b[position], length) of each run consecutive in both lists."""
    i, n = 0, len(a)
    while i < n:
        j = i + 1
        while j < n and a[j] == a[j - 1] + 1 and b[j] == b[j - 1] + 1:
            j += 1
        yield i, a[i], b[i], j - i
        i = j


def copy_out_runs(host: torch.Tensor, host_ids: list[int], dev: torch.Tensor,
                  dev_ids: list[int]) -> None:
    """host[host_ids] = dev[:, :, dev_ids] (CPU): one strided slice copy per run (several
    times faster than index_select + index_copy_, which go element by element)."""
    for _, h, d, k in runs(host_ids, dev_ids):
        host[h : h + k].copy_(dev[:, :, d : d + k].movedim(2, 0))


def copy_in_runs(dev: torch.Tensor, dev_ids: list[int], host: torch.Tensor,
                 host_ids: list[int]) -> None:
    """dev[:, :, dev_ids] = host[host_ids] (CPU), one slice copy per run."""
    for _, d, h, k in runs(dev_ids, host_ids):
        # the destination viewed block-major: torch walks the contiguous source in order
        # (about 10% faster here than the source viewed layer-major)
        dev[:, :, d : d + k].movedim(2, 0).copy_(host[h : h + k])


def gather_blocks(dev: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = block idx[i] of the layer-major pool, block-major: one index_select."""
    torch.index_select(dev.movedim(2, 0), 0, idx, out=out)


def scatter_blocks(dev: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """Block idx[i] of the layer-major pool = src[i] (block-major): one index_copy_."""
    dev.index_copy_(2, idx, src.movedim(0, 2))


def _device_index(ids: list[int], device: torch.device) -> torch.Tensor:
    # from pinned memory, so the copy is truly asynchronous (a pageable source makes CUDA
    # synchronise the stream first); the caching host allocator keeps it until the copy ran
    return torch.tensor(ids, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


class BlockCopier:
    def __init__(self, device_kv: torch.Tensor, host_kv: torch.Tensor) -> None:
        self.dev = device_kv
        self.host = host_kv
        self.block_bytes = host_kv[0].numel() * host_kv.element_size()
        self.cuda = device_kv.device.type == "cuda"
        self.streams: dict[str, torch.cuda.Stream] = (
            {d: torch.cuda.Stream(device_kv.device) for d in ("out", "in")} if self.cuda else {})
        self._bufs: dict[str, torch.Tensor | None] = {"out": None, "in": None}
        self._scattered: torch.cuda.Event | None = None  # the in-buffer's last scatter
        self._loads: list[tuple[torch.cuda.Event, frozenset[int]]] = []  # restores in flight
        # hears every timed copy (direction, bytes, seconds): the restore cost's average
        self.cost: RestoreCost | None = None
        # tests: sleep this long inside every asynchronous write-back before it reads the device
        self.delay_s = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: list[Transfer] = []  # device -> host copies, in issue order
        self._lock = threading.Lock()
        self.reset_figures()

    def reset_figures(self) -> None:
        """Zero the copy figures (after the start-up calibration)."""
        self.bytes_copied = 0
        self.copy_s = 0.0  # time of the timed copies (bandwidth figure)
        self.timed_bytes = 0
        # CPU: wall time of the synchronous copies; CUDA: CUDA-event time of every copy
        self._seconds = {"out": 0.0, "in": 0.0}  # device->host / host->device
        self._blocks = {"out": 0, "in": 0}
        # CUDA copies whose events have not been read yet: (start, end, blocks, direction)
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event, int, str]] = []

    def _nbytes(self, n: int) -> int:
        return n * self.block_bytes

    def _buffer(self, direction: str, n: int) -> torch.Tensor:
        """The first n blocks of the direction's device buffer (grown when too small; call
        on the side stream that uses it, so the allocator orders its memory there)."""
        buf = self._bufs[direction]
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((n, *self.host.shape[1:]), dtype=self.dev.dtype, device=self.dev.device)
            self._bufs[direction] = buf
        return buf[:n]

    # ---- device -> host ------------------------------------------------------------------
    def to_host_async(self, dev_ids: list[int], host_ids: list[int]) -> Transfer:
        if not dev_ids:
            return Transfer(0)
        nbytes = self._nbytes(len(dev_ids))
        if self.cuda:
            t = self._cuda_copy_out(dev_ids, host_ids, nbytes)
        elif self.delay_s > 0:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-writeback")
            t = Transfer(nbytes, future=self._pool.submit(self._delayed_copy, dev_ids, host_ids),
                         blocks=frozenset(host_ids))
        else:
            self.to_host(dev_ids, host_ids)
            return Transfer(0)
        self.bytes_copied += nbytes  # CPU: not timed (bandwidth counts the synchronous copies)
        self._track(t)
        return t

    def _track(self, t: Transfer) -> None:
        with self._lock:
            self._inflight = [x for x in self._inflight if not x.done()] + [t]

    def _cuda_copy_out(self, dev_ids: list[int], host_ids: list[int], nbytes: int) -> Transfer:
        side = self.streams["out"]
        side.wait_stream(torch.cuda.current_stream(self.dev.device))  # reads what the forward wrote
        blocks = frozenset(host_ids)
        for ev, read in self._live_loads():
            if read & blocks:
                side.wait_event(ev)  # a restore still loads these host blocks
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            idx = _device_index(dev_ids, self.dev.device)
            buf = self._buffer("out", len(dev_ids))
            start.record(side)
            gather_blocks(self.dev, idx, buf)
            for i, h, _, k in runs(host_ids, list(range(len(host_ids)))):
                self.host[h : h + k].copy_(buf[i : i + k], non_blocking=True)
            end.record(side)
        with self._lock:
            self._timing.append((start, end, len(dev_ids), "out"))
        return Transfer(nbytes, event=end, blocks=blocks)

    def _live_loads(self) -> list[tuple[torch.cuda.Event, frozenset[int]]]:
        self._loads = [(ev, b) for ev, b in self._loads if not ev.query()]
        return self._loads

    def _delayed_copy(self, dev_ids: list[int], host_ids: list[int]) -> None:
        time.sleep(self.delay_s)
        copy_out_runs(self.host, host_ids, self.dev, dev_ids)

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
            self._track(t)
            self.bytes_copied += t.nbytes
            return
        t0 = time.perf_counter()
        copy_out_runs(self.host, host_ids, self.dev, dev_ids)
        self._timed(t0, len(dev_ids), "out")

    # ---- host -> device ------------------------------------------------------------------
    def to_device(self, host_ids: list[int], dev_ids: list[int]) -> None:
        """Load host blocks into (freshly allocated) device blocks, before the forward."""
        if not host_ids:
            return
        if self.cuda:
            self._cuda_copy_in(host_ids, dev_ids)
            return
        self.wait_all()
        t0 = time.perf_counter()
        copy_in_runs(self.dev, dev_ids, self.host, host_ids)
        self._timed(t0, len(host_ids), "in")

    def _cuda_copy_in(self, host_ids: list[int], dev_ids: list[int]) -> None:
        compute = torch.cuda.current_stream(self.dev.device)
        side = self.streams["in"]
        blocks = frozenset(host_ids)
        with self._lock:
            writes = [t for t in self._inflight if t.event is not None and t.blocks & blocks]
        for t in writes:
            side.wait_event(t.event)  # never read a host block still being filled
        if self._scattered is not None:
            side.wait_event(self._scattered)  # the buffer's last scatter has read it
        start, loaded = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            idx = _device_index(dev_ids, self.dev.device)
            buf = self._buffer("in", len(host_ids))
            start.record(side)
            for i, h, _, k in runs(host_ids, list(range(len(host_ids)))):
                buf[i : i + k].copy_(self.host[h : h + k], non_blocking=True)
            loaded.record(side)
        compute.wait_event(loaded)
        scatter_blocks(self.dev, idx, buf)
        # made on the side stream, read on the compute stream: freed only after that ran
        idx.record_stream(compute)
        buf.record_stream(compute)
        self._scattered = torch.cuda.Event()
        self._scattered.record(compute)
        self._live_loads().append((loaded, blocks))
        with self._lock:
            self._timing.append((start, loaded, len(host_ids), "in"))
        self.bytes_copied += self._nbytes(len(host_ids))

    # ---- waiting, CPU-side access ----------------------------------------------------------
    def wait_all(self) -> None:
        """Wait for every device -> host copy in flight."""
        with self._lock:
            pending, self._inflight = self._inflight, []
        for t in pending:
            t.wait()

    def _quiesce(self) -> None:
        """Nothing in flight reads or writes the host pool (CPU access follows)."""
        self.wait_all()
        for ev, _ in self._loads:
            ev.synchronize()
        self._loads = []

    def read(self, host_ids: list[int]) -> torch.Tensor:
        """Host blocks as one block-major tensor [n, L, 2, bs, H, D] (snapshot export)."""
        self._quiesce()
        return self.host.index_select(0, torch.tensor(host_ids, dtype=torch.long))

    def write(self, host_ids: list[int], data: torch.Tensor) -> None:
        """Fill host blocks from a block-major tensor (snapshot import)."""
        self._quiesce()
        self.host.index_copy_(0, torch.tensor(host_ids, dtype=torch.long), data.to(self.host.dtype))

    def timed_round(self, direction: str, dev_ids: list[int], host_ids: list[int]) -> float:
        """Wall seconds of one synchronous copy through the real path (calibration)."""
        if self.cuda:
            torch.cuda.synchronize(self.dev.device)
        t0 = time.perf_counter()
        if direction == "out":
            self.to_host(dev_ids, host_ids)
        else:
            self.to_device(host_ids, dev_ids)
        if self.cuda:
            torch.cuda.synchronize(self.dev.device)
        return time.perf_counter() - t0

    # ---- figures -------------------------------------------------------------------------
    def _timed(self, t0: float, n: int, direction: str) -> None:
        dt = time.perf_counter() - t0
        self._count(n, direction, dt)
        self.bytes_copied += self._nbytes(n)

    def _count(self, n: int, direction: str, dt: float) -> None:
        self.copy_s += dt
        self.timed_bytes += self._nbytes(n)
        self._seconds[direction] += dt
        self._blocks[direction] += n
        if self.cost is not None:
            self.cost.observe_copy(direction, self._nbytes(n), dt)

    def settle(self, block: bool = False) -> None:
        """Fold finished CUDA copies' event times into the figures and the cost model's
        average (all of them, waiting for the events, when `block`: reporting only)."""
        with self._lock:
            pending, self._timing = self._timing, []
        keep = []
        for start, end, n, direction in pending:
            if not block and not end.query():
                keep.append((start, end, n, direction))
                continue
            end.synchronize()
            self._count(n, direction, start.elapsed_time(end) / 1e3)
        with self._lock:
            self._timing = keep + self._timing

    @property
    def pending_timings(self) -> bool:
        return bool(self._timing)

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
        self._quiesce()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
