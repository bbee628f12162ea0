"""A rank of a tensor-parallel engine, as its own process: `python -m
kvserve.workers.model.parallel.shard_main FD`, FD its end of the socket pair to rank 0.

It joins the group, loads its shard, answers "ready", then runs rank 0's messages in order
(`messages.py`) until "close". Any failure is sent to rank 0 as ("error", kind, text)
before the process exits; the socket closing (rank 0 gone) ends it too.
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.workers.loading.sharding import Shard
from kvserve.workers.model.parallel.executor import ShardExecutor
from kvserve.workers.model.parallel.group import ParallelGroup


def serve(conn: Connection, init: dict[str, Any]) -> None:
    config = EngineConfig(**init["config"])
    rank, size = init["rank"], init["size"]
    device = torch.device(init["device"])
    if device.type == "cpu":
        torch.set_num_threads(config.rank_threads())
    group = ParallelGroup.connect(init["port"], rank, size, device, init["timeout_s"])
    shard = ShardExecutor(init["path"], config, Shard(rank, size), group, device)
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        kind = msg[0]
        if kind == "step":
            shard.step(msg[1])
        elif kind == "to_host":
            shard.to_host(msg[1], msg[2])
        elif kind == "to_device":
            shard.to_device(msg[1], msg[2])
        elif kind == "write":
            shard.write(msg[1], msg[2])
        elif kind == "read":
            conn.send(("data", shard.read(msg[1])))
        elif kind == "host":
            shard.start_host(msg[1])
            conn.send(("done",))
        elif kind == "close":
            return
        else:
            raise ValueError(f"unknown message {kind!r}")


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    try:
        serve(conn, conn.recv())
    except (EOFError, ConnectionError):
        pass  # rank 0 is gone: nothing left to serve
    except BaseException as e:
        traceback.print_exc()  # into the worker's log, beside rank 0's
        try:
            conn.send(("error", type(e).__name__, str(e)))
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown (seconds with torch and a process group)
