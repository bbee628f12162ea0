"""The restore cost model: copy (bytes / bandwidth + latency) against recompute (tokens /
prefill rate), forced policies, and the moving averages that keep the figures current."""

from __future__ import annotations

import pytest

from kvserve.config import EngineConfig
from kvserve.kvcache.restore_cost import DECISIONS, Choice, RestoreCost, host_tier_summary, stat_key

KB = 1000  # bytes per token in these tests


def model(gbps_out: float, gbps_in: float, tokens_per_s: float, latency_s: float = 0.0,
          policy: str = "cost") -> RestoreCost:
    c = RestoreCost(KB, policy)
    c.set_copy("out", 1e-9 / gbps_out, latency_s)
    c.set_copy("in", 1e-9 / gbps_in, latency_s)
    c.set_prefill(1000, 1000 / tokens_per_s)
    return c


def test_copy_when_cheaper_recompute_when_not():
    # 1 KB per token at 1 GB/s: 1 us per token and direction; prefill at 100k tokens/s: 10 us
    c = model(1.0, 1.0, 1e5)
    assert c.copy_s(100) == pytest.approx(100e-6)
    assert c.copy_s(100, ("out", "in")) == pytest.approx(200e-6)
    assert c.recompute_s(100) == pytest.approx(1e-3)
    assert c.choose(100) == Choice(True, "cheaper_to_copy")
    assert c.choose(100, round_trip=True).copy
    # a GPU that prefills 10M tokens/s behind a 1 GB/s link: recompute
    fast = model(1.0, 1.0, 1e7)
    assert fast.choose(100) == Choice(False, "cheaper_to_recompute")
    assert fast.choose(100).decision == "recompute"


def test_round_trip_and_latency_can_tip_the_choice():
    # in alone: 100 us < 150 us recompute; out and in: 200 us > 150 us
    c = model(1.0, 1.0, 100 / 150e-6)
    assert c.choose(100).copy and not c.choose(100, round_trip=True).copy
    # a fixed 1 ms per copy makes a one-block copy dearer than recomputing 16 tokens
    slow_start = model(100.0, 100.0, 1e5, latency_s=1e-3)
    assert not slow_start.choose(16).copy
    assert slow_start.choose(100_000).copy  # the latency is paid once per copy


def test_forced_policies_and_unmeasured():
    assert model(1.0, 1.0, 1e9, policy="copy").choose(10) == Choice(True, "policy")
    assert model(1e3, 1e3, 1.0, policy="recompute").choose(10) == Choice(False, "policy")
    assert RestoreCost(KB).choose(10) == Choice(True, "unmeasured")  # no figures: as before
    with pytest.raises(ValueError, match="host restore policy must be one of"):
        RestoreCost(KB, "sometimes")


def test_config_validates_the_policy():
    assert EngineConfig().host_restore_policy == "cost"
    assert EngineConfig(host_restore_policy="recompute").host_restore_policy == "recompute"
    with pytest.raises(ValueError, match="host_restore_policy"):
        EngineConfig(host_restore_policy="sometimes")


def test_moving_averages():
    c = model(1.0, 1.0, 1e5, latency_s=10e-6)
    # a large copy at 2 GB/s (plus the latency) moves the bandwidth towards 2 GB/s
    for _ in range(40):
        c.observe_copy("in", 10_000_000, 10e-6 + 10_000_000 * 0.5e-9)
    assert c.gbps("in") == pytest.approx(2.0, rel=1e-3)
    assert c.gbps("out") == pytest.approx(1.0)  # the other direction is untouched
    # small copies that take 60 us move the latency, not the bandwidth
    for _ in range(40):
        c.observe_copy("in", 1000, 60e-6 + 1000 * 0.5e-9)
    assert c.latency_s["in"] == pytest.approx(60e-6, rel=1e-3)
    assert c.gbps("in") == pytest.approx(2.0, rel=1e-3)
    for _ in range(40):
        c.observe_prefill(500, 500 / 2e5)
    assert c.prefill_tokens_per_s == pytest.approx(2e5, rel=1e-3)
    c.observe_prefill(0, 1.0)  # nothing computed: ignored
    c.observe_copy("out", 0, 1.0)
    assert c.prefill_tokens_per_s == pytest.approx(2e5, rel=1e-3) and c.gbps("out") == pytest.approx(1.0)


def test_figures_and_summary():
    c = model(3.0, 6.0, 1234.0, latency_s=5e-6)
    f = c.figures()
    assert f["host_copy_gbps_d2h"] == pytest.approx(3.0) and f["host_copy_gbps_h2d"] == pytest.approx(6.0)
    assert f["host_copy_latency_us_d2h"] == pytest.approx(5.0)
    assert f["prefill_tokens_per_s"] == pytest.approx(1234.0)
    assert set(RestoreCost(KB).figures().values()) == {0.0}
    stats = {**f, stat_key("copy", "cheaper_to_copy"): 7.0, "writebacks_skipped": 2.0}
    s = host_tier_summary(stats, "cost")
    assert s["restore_policy"] == "cost" and s["copy_gbps_h2d"] == pytest.approx(6.0)
    assert s["restores"] == {f"{d}/{r}": 7 if (d, r) == ("copy", "cheaper_to_copy") else 0
                             for d, r in DECISIONS}
    assert s["writebacks_skipped"] == 2
