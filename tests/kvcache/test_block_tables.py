"""The persistent block-table array: rows follow streams joining, growing, rolling back and
leaving, only the written entries are sent to a device mirror, and the array grows when more
streams run than it has rows."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.kvcache.block_tables import BlockTables
from kvserve.kvcache.manager import KVCacheManager, StreamStep


def test_join_grow_leave_and_reuse_rows() -> None:
    t = BlockTables(width=6, slots=2)
    a = t.add([3, 4])
    b = t.add([7])
    assert (a, b) == (0, 1)
    t.write(a, 2, [5, 9])
    assert t.array[a, :4].tolist() == [3, 4, 5, 9] and t.array[b, 0] == 7
    t.remove(a)
    c = t.add([1])  # the lowest free row
    assert c == 0 and t.array[c, 0] == 1
    # a third stream: the array doubles and keeps every row
    d = t.add([8, 8])
    assert t.slots == 4 and t.capacity_changes == 1 and d == 2
    assert t.array[b, 0] == 7 and t.array[c, 0] == 1 and t.array[d, :2].tolist() == [8, 8]
    assert t.free_slots() == [3]


def test_updates_hold_only_written_entries() -> None:
    t = BlockTables(width=5, slots=3)
    t.track = True
    s0 = t.add([1, 2, 3])
    s1 = t.add([4])
    idx, vals = t.take_updates()
    assert sorted(zip(idx.tolist(), vals.tolist(), strict=True)) == [(0, 1), (1, 2), (2, 3), (5, 4)]
    t.write(s1, 1, [6])  # one gained block: one entry
    idx, vals = t.take_updates()
    assert idx.tolist() == [s1 * 5 + 1] and vals.tolist() == [6]
    assert t.take_updates()[0].size == 0
    # a mirror that applies the updates equals the array on the rows in use
    mirror = np.zeros_like(t.array)
    t.remove(s0)
    s2 = t.add([9, 9])
    t.write(s2, 2, [7])
    for i, v in zip(*t.take_updates(), strict=True):
        mirror.ravel()[i] = v
    assert mirror[s2, :3].tolist() == [9, 9, 7]


def test_manager_rows_follow_reserve_commit_rollback_free() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4, max_blocks_per_stream=6, slots=2)
    a = list(range(100, 110))
    plan = kv.reserve([StreamStep("a", a, 10)])
    kv.commit(plan)
    sa = kv.stream("a").slot
    assert plan.streams[0].slot == sa and plan.tables is kv.tables
    assert kv.tables.array[sa, :3].tolist() == kv.block_table("a")
    # a decode step that fills no new block writes nothing
    kv.tables.track = True
    a.append(1)
    kv.commit(kv.reserve([StreamStep("a", a, 11)]))
    assert kv.tables.take_updates()[0].size == 0
    # growing into a new block writes one entry; rolling it back leaves the row as it was
    a += [2, 3]
    plan = kv.reserve([StreamStep("a", a, 13), StreamStep("b", [5] * 9, 9)])
    assert kv.tables.array[sa, :4].tolist() == kv.block_table("a")
    sb = kv.stream("b").slot
    kv.rollback(plan)
    kv.check_invariants()
    assert not kv.has_stream("b") and sb in kv.tables.free_slots()
    assert len(kv.block_table("a")) == 3
    kv.commit(kv.reserve([StreamStep("a", a, 13)]))
    kv.check_invariants()
    # more streams than rows: the array grows, rows stay consistent
    for i in range(3):
        kv.commit(kv.reserve([StreamStep(f"s{i}", [i] * 5, 5)]))
    assert kv.tables.slots == 4
    kv.check_invariants()
    kv.free("a")
    kv.check_invariants()
    assert sa in kv.tables.free_slots()
    kv.hold("s0")  # a parked stream leaves the batch but keeps its blocks
    kv.check_invariants()
    kv.release_held("s0")


def test_a_stream_longer_than_its_row_is_refused_before_any_change() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4, max_blocks_per_stream=2)
    with pytest.raises(ValueError, match="exceed the 2-block table"):
        kv.reserve([StreamStep("a", list(range(9)), 9)])
    kv.commit(kv.reserve([StreamStep("a", list(range(8)), 8)]))
    before = (list(kv.pool.ref_cnt), kv.tables.free_slots())
    with pytest.raises(ValueError, match="exceed the 2-block table"):
        kv.reserve([StreamStep("a", list(range(9)), 9)])
    assert (list(kv.pool.ref_cnt), kv.tables.free_slots()) == before
    kv.check_invariants()
