"""The router's decision kinds: a prefix decision is device or host affinity by where it lives."""

from __future__ import annotations

from kvserve.router.metrics import POLICY_KINDS, decision_kind
from kvserve.router.policy import POLICIES, Decision, WorkerView


def test_prefix_decisions_split_by_tier():
    w = WorkerView(0, "worker-0", held_device={1, 2}, held_host={3}, pending={4: 0.0})
    assert decision_kind(Decision(0, "prefix", 2), w, [1, 2, 3]) == "device_affinity"
    assert decision_kind(Decision(0, "prefix", 3), w, [1, 2, 3]) == "host_affinity"
    assert decision_kind(Decision(0, "prefix", 1), w, [4, 9]) == "device_affinity"  # just routed


def test_other_decisions_keep_their_reason():
    w = WorkerView(0, "worker-0")
    for reason in ("session", "least_loaded", "round_robin"):
        assert decision_kind(Decision(0, reason), w, [1]) == reason


def test_every_policy_has_its_kinds():
    assert set(POLICY_KINDS) == set(POLICIES)
