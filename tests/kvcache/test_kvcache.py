"""Block pool and per-stream KV manager: sharing, plan/apply atomicity, no leaks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.kvcache.manager import KVCacheFull, KVCacheManager, StreamStep

BS = 4


def snapshot(m: KVCacheManager):
    return (
        list(m.pool.ref_cnt),
        list(m.pool.free_queue),
        dict(m.pool.cached),
        {
            k: (list(s.block_ids), s.num_computed, list(s.block_hashes))
            for k, s in m.streams.items()
        },
    )


def state(m: KVCacheManager):
    """What a rolled-back step must restore (cached content of reused blocks may be dropped)."""
    return (
        list(m.pool.ref_cnt),
        sorted(m.pool.free_queue),
        {
            k: (list(s.block_ids), s.num_computed, list(s.block_hashes))
            for k, s in m.streams.items()
        },
    )


def run(m: KVCacheManager, steps: list[StreamStep]):
    plan = m.reserve(steps)
    m.commit(plan)
    return plan


def test_shared_prefix_stored_once():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    system = list(range(100, 112))  # 3 full blocks
    a = system + [1, 2, 3]
    b = system + [7, 8]
    run(m, [StreamStep("a", a, len(a))])
    used_after_a = m.pool.num_used
    plan = run(m, [StreamStep("b", b, len(b))])
    # b reuses a's three full blocks and only computes its own tail
    assert plan.streams[0].start == 12
    assert m.block_table("b")[:3] == m.block_table("a")[:3]
    assert m.pool.num_used == used_after_a + 1
    assert [m.pool.ref_cnt[x] for x in m.block_table("a")[:3]] == [2, 2, 2]
    assert m.prefix_hit_rate() == pytest.approx(12 / (len(a) + len(b)))
    m.free("a")
    m.free("b")
    m.check_invariants()
    assert m.pool.num_free == 16


def test_last_token_always_computed():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    p = list(range(8))  # exactly two full blocks
    run(m, [StreamStep("a", p, 8)])
    plan = run(m, [StreamStep("b", p, 8)])
    # a full hit would leave nothing to compute, so the last block is recomputed
    assert plan.streams[0].start == 4


def test_freed_prefix_revived_until_reused():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    p = list(range(9))
    run(m, [StreamStep("a", p, 9)])
    m.free("a")
    assert m.pool.num_free == 4
    plan = run(m, [StreamStep("b", p, 9)])
    assert plan.streams[0].start == 8
    m.free("b")
    # a new, unrelated stream takes every block; the old prefix is gone
    run(m, [StreamStep("c", list(range(50, 66)), 16)])
    m.free("c")
    plan = run(m, [StreamStep("d", p, 9)])
    assert plan.streams[0].start == 0


def test_failed_plan_changes_nothing():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    run(m, [StreamStep("a", list(range(10)), 10)])  # 3 blocks
    before = snapshot(m)
    with pytest.raises(KVCacheFull):
        # a grows by one block and b needs three: one more than is free
        m.reserve([StreamStep("a", list(range(13)), 13), StreamStep("b", list(range(20, 32)), 12)])
    assert snapshot(m) == before


def test_rollback_restores_state():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    run(m, [StreamStep("a", list(range(6)), 6)])
    before = state(m)
    plan = m.reserve([StreamStep("a", list(range(11)), 11), StreamStep("b", list(range(6)), 6)])
    m.rollback(plan)  # as if the forward pass had raised
    assert state(m) == before
    m.check_invariants()


def test_long_stream_next_to_many_short_ones():
    # one 8k-token stream and thirty short ones share a pool sized exactly for them
    bs = 16
    m = KVCacheManager(num_blocks=8192 // bs + 30 * 2, block_size=bs)
    steps = [StreamStep("long", list(range(8192)), 8192)]
    steps += [StreamStep(f"s{i}", [i] * 20, 20) for i in range(30)]
    run(m, steps)
    assert m.pool.num_free == 0
    assert len(m.block_table("long")) == 512
    m.check_invariants()


def test_pool_double_free_detected():
    p = BlockPool(2)
    (b,) = p.allocate(1)
    p.release([b])
    with pytest.raises(RuntimeError):
        p.release([b])


def test_device_cache_moves_blocks_in_one_copy():
    c = DeviceKVCache(
        num_layers=3,
        num_blocks=8,
        block_size=4,
        num_kv_heads=2,
        head_dim=5,
        dtype=torch.float32,
        device="cpu",
    )
    c.kv.normal_()
    data = c.read_blocks([5, 1, 6])
    assert data.shape == (3, 2, 3, 4, 2, 5)
    c2 = DeviceKVCache(3, 8, 4, 2, 5, torch.float32, "cpu")
    c2.write_blocks([0, 2, 3], data)
    assert torch.equal(c2.kv[:, :, 0], c.kv[:, :, 5])
    assert torch.equal(c2.kv[:, :, 3], c.kv[:, :, 6])


class KVMachine(RuleBasedStateMachine):
    """Random allocate/append/share/fail/rollback/free sequences never leak or double-free."""

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(num_blocks=24, block_size=BS)
        self.tokens: dict[str, list[int]] = {}
        self.n = 0

    @rule(
        prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
        tail=st.lists(st.integers(0, 5), min_size=1, max_size=20),
    )
    def admit(self, prefix, tail):
        sid = f"s{self.n}"
        self.n += 1
        toks = prefix + tail
        target = len(toks)
        before = snapshot(self.m)
        try:
            run(self.m, [StreamStep(sid, toks, target)])
            self.tokens[sid] = toks
        except KVCacheFull:
            assert snapshot(self.m) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), grow=st.integers(1, 9), fail=st.booleans())
    def extend(self, data, grow, fail):
        sids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        steps = []
        for sid in sids:
            self.tokens[sid] = self.tokens[sid] + [7] * grow
            steps.append(StreamStep(sid, self.tokens[sid], len(self.tokens[sid])))
        before, before_state = snapshot(self.m), state(self.m)
        try:
            plan = self.m.reserve(steps)
        except KVCacheFull:
            assert snapshot(self.m) == before
            for sid in sids:
                self.tokens[sid] = self.tokens[sid][:-grow]
            return
        if fail:  # the forward pass raised midway
            self.m.rollback(plan)
            assert state(self.m) == before_state
            for sid in sids:
                self.tokens[sid] = self.tokens[sid][:-grow]
        else:
            self.m.commit(plan)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(sid)
        del self.tokens[sid]

    @invariant()
    def consistent(self):
        self.m.check_invariants()
        for sid, toks in self.tokens.items():
            assert self.m.num_computed(sid) == len(toks)
        # blocks in use are exactly those referenced by live streams
        live = {b for sid in self.tokens for b in self.m.stream(sid).live_blocks}
        assert self.m.pool.num_used == len(live)

    def teardown(self):
        for sid in list(self.tokens):
            self.m.free(sid)
        self.m.check_invariants()
        assert self.m.pool.num_free == self.m.pool.num_blocks


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)

WINDOW = 6  # keys a query sees, itself included: the window starts mid-block


class WindowedKVMachine(KVMachine):
    """The same with a sliding window on every layer: a stream's leading blocks are released
    as soon as its next query cannot reach them, and only then."""

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(num_blocks=24, block_size=BS, window=WINDOW)

    @invariant()
    def only_unreachable_blocks_dropped(self):
        for sid in self.tokens:
            s = self.m.stream(sid)
            assert s.num_dropped == max(0, (s.num_computed - WINDOW + 1) // BS)


TestWindowedKVMachine = WindowedKVMachine.TestCase
TestWindowedKVMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_window_releases_blocks_and_keeps_them_cached():
    """A stream growing past its window holds about window / block_size blocks; the blocks it
    released stay in the prefix cache, so a new stream with the same start still finds them."""
    m = KVCacheManager(num_blocks=12, block_size=BS, window=WINDOW)
    toks = list(range(100, 105))
    run(m, [StreamStep("a", toks, len(toks))])
    for i in range(30):  # decode far past the window, one token per step
        toks = toks + [200 + i]
        run(m, [StreamStep("a", toks, len(toks))])
        assert len(m.stream("a").live_blocks) <= -(-WINDOW // BS) + 1
    assert m.blocks_dropped == m.stream("a").num_dropped == (len(toks) - WINDOW + 1) // BS
    # a second stream whose prompt is the first one's start: its first blocks are cached
    plan = run(m, [StreamStep("b", toks[:9], 9)])
    assert plan.streams[0].start == 8
    m.free("a")
    m.free("b")
    m.check_invariants()
    assert m.pool.num_free == m.pool.num_blocks


@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(1, 6))
@settings(max_examples=100, deadline=None)
def test_hash_prefix_property(tokens, bs):
    """Equal prefixes give equal block hashes; a change anywhere changes every later hash."""
    from kvserve.kvcache.hashing import hash_full_blocks

    h = hash_full_blocks(tokens, bs)
    assert len(h) == len(tokens) // bs
    if tokens:
        changed = list(tokens)
        changed[0] += 1
        h2 = hash_full_blocks(changed, bs)
        assert all(x != y for x, y in zip(h, h2, strict=True))
