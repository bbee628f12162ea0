"""Rank 0's side of a tensor-parallel engine: it starts ranks 1..N-1, joins them in the
process group, sends them every step and host-tier copy, and notices when one dies.

Each rank is its own process (`python -m ...parallel.shard_main`), started here whether the
engine runs offline (`LLM(tensor_parallel_size=2)`) or in a Ray worker actor, on the same
node and with the same environment (a CUDA worker's CUDA_VISIBLE_DEVICES lists all of its
GPUs: rank r takes the r-th). Control messages (`messages.py`) go over a socket pair per
rank, tensors of the forward through the group's collectives.

A rank that dies fails the engine, never hangs it: gloo's next collective raises at once
(its sockets close), on CUDA a watcher aborts the NCCL group when a rank's process exits,
a message to a dead rank fails, and every later step raises the same EngineDeadError
naming the rank. A rank whose parent dies sees its socket close and exits; `close` stops
them all, and so does the object's finalizer, so no process is left behind.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.errors import EngineDeadError, ModelLoadError
from kvserve.kvcache.block_tables import BlockTables
from kvserve.workers.loading.sharding import Shard
from kvserve.workers.model.parallel.group import ParallelGroup
from kvserve.workers.model.parallel.host_shards import ShardedCopier
from kvserve.workers.model.parallel.messages import StepMessage
from kvserve.workers.model.parallel.tables import TableMirror, TableSync
from kvserve.workers.model.step_inputs import StepInputs

log = logging.getLogger(__name__)

SHARD_MAIN = "kvserve.workers.model.parallel.shard_main"
# A collective that waits this long fails (a rank alive but stuck); a dead rank fails it at once
COLLECTIVE_TIMEOUT_S = 300.0
CLOSE_WAIT_S = 10.0


class ShardRanks:
    def __init__(self, path: str, config: EngineConfig) -> None:
        """Start ranks 1..N-1 on the model at `path` (already resolved) and join them."""
        self.size = config.tensor_parallel_size
        self.devices = config.rank_devices()
        self.failed: str | None = None
        self.closed = False
        self.sync: TableSync | None = None
        self._store = ParallelGroup.host_store(self.size, COLLECTIVE_TIMEOUT_S)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        env = dict(os.environ)
        if self.devices[0] == "cpu":  # the engine's threads shared by its ranks
            env["OMP_NUM_THREADS"] = str(config.rank_threads())
        try:
            for rank in range(1, self.size):
                self._spawn(rank, path, config, env)
        except BaseException:
            self.close()
            raise
        # rank 0 joins in the background: the caller loads its shard meanwhile
        self._joined: list[Any] = []
        self._join_thread = threading.Thread(target=self._join, name="kvserve-tp-join", daemon=True)
        self._join_thread.start()
        self._watcher: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        """The processes of ranks 1..N-1."""
        return [p.pid for p in self.procs]

    def shard(self, rank: int) -> Shard:
        return Shard(rank, self.size)

    # ---- start-up --------------------------------------------------------------------------
    def _spawn(self, rank: int, path: str, config: EngineConfig, env: dict[str, str]) -> None:
        mine, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen([sys.executable, "-m", SHARD_MAIN, str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),), env=env)
        finally:
            theirs.close()
        self.procs.append(proc)
        conn = Connection(mine.detach())
        self.conns.append(conn)
        conn.send({"path": path, "config": config.model_dump(), "rank": rank, "size": self.size,
                   "port": self._store.port, "device": self.devices[rank],
                   "timeout_s": COLLECTIVE_TIMEOUT_S})

    def _join(self) -> None:
        try:
            device = torch.device(self.devices[0])
            self._joined.append(ParallelGroup.join(self._store, 0, self.size, device,
                                                   COLLECTIVE_TIMEOUT_S))
        except BaseException as e:  # handed to wait_ready
            self._joined.append(e)

    def wait_ready(self) -> None:
        """Until every rank has joined the group and loaded its shard (watching that none
        died meanwhile); a rank's failure is raised here (a ModelLoadError as such)."""
        try:
            while self._join_thread.is_alive():
                self._join_thread.join(0.2)
                self._check_started()
            joined = self._joined[0]
            if isinstance(joined, BaseException):
                raise self.fail(f"the ranks did not connect: {joined}") from joined
            self.group: ParallelGroup = joined
            for rank in range(1, self.size):
                self._reply(rank, "ready")
        except BaseException:
            self.close()
            raise
        if self.devices[0].startswith("cuda"):
            self._watcher = threading.Thread(target=self._watch, name="kvserve-tp-watch", daemon=True)
            self._watcher.start()

    def track_tables(self, tables: BlockTables) -> TableMirror:
        """Send `tables`' changes with every step; returns rank 0's own mirror of them."""
        self.sync = TableSync(tables)
        return self.sync.mirror

    def copier(self, num_kv_heads: int) -> Callable[[torch.Tensor, torch.Tensor], ShardedCopier]:
        """HostTier's `make_copier` on rank 0; whole blocks hold the model's `num_kv_heads`."""
        return lambda device_kv, host_kv: ShardedCopier(self, num_kv_heads, device_kv, host_kv)

    def start_host(self, num_blocks: int) -> None:
        """Every rank's host pool of `num_blocks` blocks (0: no host tier)."""
        self.send(("host", num_blocks))
        self.replies("done")

    # ---- messages --------------------------------------------------------------------------
    def send_step(self, step: StepInputs) -> None:
        assert self.sync is not None
        self.send(("step", StepMessage.of(step, self.sync.take())))

    def send(self, msg: tuple) -> None:
        """`msg` to every other rank."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(1, self.size):
            self._send_bytes(rank, data)

    def send_to(self, rank: int, msg: tuple) -> None:
        self._send_bytes(rank, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_bytes(self, rank: int, data: bytes) -> None:
        self._alive()
        try:
            self.conns[rank - 1].send_bytes(data)
        except OSError as e:
            raise self.fail(f"rank {rank} cannot be reached: {e}") from e

    def replies(self, kind: str) -> list[tuple]:
        """The answer `kind` of every other rank, in rank order."""
        return [self._reply(rank, kind) for rank in range(1, self.size)]

    def _reply(self, rank: int, kind: str) -> tuple:
        self._alive()
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        while True:
            try:
                if conn.poll(0.2):
                    msg = conn.recv()
                    break
            except (EOFError, OSError):
                raise self.fail(f"rank {rank} closed its connection") from None
            if proc.poll() is not None:
                raise self.fail(f"rank {rank} exited")
        if msg[0] == "error":
            self._fail_with(rank, msg)
        if msg[0] != kind:
            raise self.fail(f"rank {rank} answered {msg[0]!r} where {kind!r} was due")
        return msg

    # ---- failures and shutdown -------------------------------------------------------------
    def _check_started(self) -> None:
        for rank, proc in enumerate(self.procs, 1):
            if proc.poll() is not None:
                conn = self.conns[rank - 1]
                if conn.poll(0):
                    try:
                        self._fail_with(rank, conn.recv())
                    except (EOFError, OSError):
                        pass
                raise self.fail(f"rank {rank} exited while starting")

    def _fail_with(self, rank: int, msg: tuple) -> None:
        _, kind, text = msg
        err = self.fail(f"rank {rank} failed: {text}")
        if kind == "ModelLoadError":
            raise ModelLoadError(text)
        raise err

    def _alive(self) -> None:
        if self.failed is not None:
            raise EngineDeadError(self.failed)
        if self.closed:
            raise EngineDeadError("the tensor-parallel ranks were shut down")

    def fail(self, reason: str) -> EngineDeadError:
        """The group is lost: stop every rank; the error says which one died, and how."""
        if self.failed is None:
            self.failed = f"tensor-parallel engine failed: {self._dead() or reason}"
            log.error("%s", self.failed)
            group = getattr(self, "group", None)
            if group is not None and self.devices[0].startswith("cuda"):
                group.abort()  # NCCL would wait for the dead rank indefinitely
            _stop(self.procs, self.conns, wait_s=0.0)
        return EngineDeadError(self.failed)

    def _dead(self) -> str:
        """Which ranks' processes ended (a dying one is given a moment to be reaped)."""
        deadline = time.monotonic() + 2.0
        out = []
        for rank, proc in enumerate(self.procs, 1):
            try:
                code = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            said = self._last_error(rank)
            out.append(f"rank {rank} (pid {proc.pid}) died ({how}){': ' + said if said else ''}")
        return "; ".join(out)

    def _last_error(self, rank: int) -> str:
        """The error a rank sent before it exited, if it did."""
        conn = self.conns[rank - 1]
        try:
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    return f"{msg[1]}: {msg[2]}"
        except (EOFError, OSError):
            pass
        return ""

    def _watch(self) -> None:
        """CUDA: a rank's exit aborts the group, or NCCL would wait for it indefinitely."""
        while not self.closed and self.failed is None:
            for proc in self.procs:
                if proc.poll() is not None and not self.closed:
                    self.fail("a rank exited")
                    return
            time.sleep(0.5)

    def close(self) -> None:
        """Stop every rank (they leave their loop, or are killed after CLOSE_WAIT_S)."""
        if self.closed:
            return
        self.closed = True
        if self.failed is None:
            msg = pickle.dumps(("close",))
            for conn in self.conns:
                try:
                    conn.send_bytes(msg)
                except OSError:
                    pass
        _stop(self.procs, self.conns, CLOSE_WAIT_S)
        self._finalizer.detach()


def _stop(procs: list[subprocess.Popen], conns: list[Connection], wait_s: float = 0.0) -> None:
    """End the rank processes (after `wait_s` for them to leave by themselves)."""
    deadline = time.monotonic() + wait_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass
