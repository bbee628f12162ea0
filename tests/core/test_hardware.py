"""available_cores honours a container's CPU quota, not only the affinity mask."""

from __future__ import annotations

from kvserve.hardware import cgroup_cpu_limit


def test_cgroup_v2_quota_in_cores(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("250000 100000\n")
    assert cgroup_cpu_limit(str(f), "/nonexistent", "/nonexistent") == 2.5
    f.write_text("max 100000\n")
    assert cgroup_cpu_limit(str(f), "/nonexistent", "/nonexistent") is None


def test_cgroup_v1_quota_and_unlimited(tmp_path):
    q, p = tmp_path / "quota", tmp_path / "period"
    q.write_text("300000\n")
    p.write_text("100000\n")
    assert cgroup_cpu_limit("/nonexistent", str(q), str(p)) == 3.0
    q.write_text("-1\n")
    assert cgroup_cpu_limit("/nonexistent", str(q), str(p)) is None
    assert cgroup_cpu_limit("/nonexistent", "/nonexistent", "/nonexistent") is None
