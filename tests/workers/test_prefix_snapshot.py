"""A session's host-cached prefix blocks carried between engines (tiny random model): the
next turn on the new engine is served from host by copy, with the same output; a record
for another geometry is refused."""

from __future__ import annotations

import msgpack
import pytest
from tiny_models import tiny_model_path

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.kvcache.hashing import hash_full_blocks
from kvserve.workers.engine.prefix_snapshot import export_prefix, import_prefix

BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


def _run(eng, ids: list[int], n: int) -> list[int]:
    rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid and o.finished:
                out = o.token_ids
    return out


def test_prefix_moves_to_another_host_tier(tiny):
    import random

    rng = random.Random(7)
    turn1 = [rng.randrange(100, 40000) for _ in range(60)]
    src = LLM(tiny, kv_cache_tokens=48 * BS, block_size=BS, host_cache_gib=0.001,
              host_restore_policy="copy").engine
    out1 = _run(src, turn1, 6)
    for _ in range(3):  # other traffic pushes the first turn's blocks from device to host
        _run(src, [rng.randrange(100, 40000) for _ in range(150)], 2)
    hashes = hash_full_blocks(turn1, BS)
    data = export_prefix(src, hashes + [12345])  # the leading run the host tier holds
    assert data and len(msgpack.unpackb(data, raw=False)["hashes"]) == len(hashes)
    dst = LLM(tiny, kv_cache_tokens=48 * BS, block_size=BS, host_cache_gib=0.001,
              host_restore_policy="copy").engine
    assert import_prefix(dst, data) == len(hashes)
    assert set(hashes) <= set(dst.held_block_hashes()["host"])
    turn2 = turn1 + out1 + [rng.randrange(100, 40000) for _ in range(10)]
    got = _run(dst, turn2, 6)
    assert dst.stats()["host_prefix_hit_tokens"] >= len(hashes) * BS
    ref = LLM(tiny, kv_cache_tokens=4096, block_size=BS, host_cache_gib=0)
    want = ref.generate(turn2, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert got == want[0].token_ids
    dst.check_invariants()
    assert dst.kv.host is not None and dst.kv.host.num_used == 0  # cached, not pinned
    bad = msgpack.unpackb(data, raw=False)
    bad["model"]["num_layers"] += 1
    with pytest.raises(InvalidRequestError, match="prefix record is for a model"):
        import_prefix(dst, msgpack.packb(bad, use_bin_type=True))
    with pytest.raises(InvalidRequestError, match="bad prefix record"):
        import_prefix(dst, b"\x01junk")
    assert export_prefix(dst, [999]) == b""  # nothing cached under that hash
