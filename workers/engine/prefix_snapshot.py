"""A session's cached prefix blocks, carried from one engine's host tier to another's.

When a session moves to another worker (its worker is drained), the blocks of its last
prompt that the old worker's host tier still caches go with it, so the next turn on the new
worker is a prefix hit served by copy. The record holds the leading run of those blocks'
hashes and their KV, in the host tier's block-major layout ([blocks, L, 2, bs, H, D]); the
target adopts them as cached (unpinned) blocks, which its LRU may evict like any other.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from kvserve.errors import InvalidRequestError
from kvserve.workers.engine.engine import LLMEngine
from kvserve.workers.engine.snapshot import _DTYPES, model_geometry

VERSION = 2  # 2: block-major KV


def export_prefix(engine: LLMEngine, hashes: list[int]) -> bytes:
    """The leading blocks of `hashes` cached in the host tier; b"" when there are none."""
    host = engine.kv.host
    if host is None:
        return b""
    ids: list[int] = []
    for h in hashes:
        hb = host.lookup(h)
        if hb is None:
            break
        ids.append(hb)
    if not ids:
        return b""
    data = host.copier.read(ids)
    record: dict[str, Any] = {
        "version": VERSION, "model": model_geometry(engine), "block_size": engine.kv.block_size,
        "hashes": hashes[: len(ids)], "dtype": str(data.dtype).removeprefix("torch."),
        "shape": list(data.shape), "data": data.contiguous().view(torch.uint8).numpy().tobytes(),
    }
    return msgpack.packb(record, use_bin_type=True)


def import_prefix(engine: LLMEngine, data: bytes) -> int:
    """Cache a prefix record's blocks in this engine's host tier; returns how many it took."""
    try:
        r = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if not isinstance(r, dict) or r.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} prefix record")
    except Exception as e:
        raise InvalidRequestError(f"bad prefix record: {e}") from e
    if r["model"] != model_geometry(engine) or r["block_size"] != engine.kv.block_size:
        raise InvalidRequestError(
            f"prefix record is for a model with {r['model']} and block size {r['block_size']}; "
            f"this engine runs {model_geometry(engine)} with {engine.kv.block_size}")
    host = engine.kv.host
    if host is None:
        return 0
    t = torch.frombuffer(bytearray(r["data"]), dtype=torch.uint8)
    t = t.view(_DTYPES[r["dtype"]]).view(r["shape"])
    hashes = list(r["hashes"])
    parked = host.adopt(t, hashes, len(hashes) * engine.kv.block_size)
    taken = len(parked.host_blocks)
    host.release(parked)  # full blocks stay cached, unpinned
    return taken
