"""The autoscaling policy (router/autoscale.py) as a pure function of the pool's load, and
Ray Serve's delays on a fake clock: what the load wants and why, the bounds, the step,
starting workers counted as capacity, parked streams counted as demand, no flapping."""

from __future__ import annotations

import pytest

from kvserve.router.autoscale import (
    Autoscaler,
    AutoscalingConfig,
    PoolLoad,
    recommend,
)

BPW = 100  # device blocks per worker


def cfg(**kw) -> AutoscalingConfig:
    base = {"enabled": True, "min_workers": 1, "max_workers": 4, "upscale_delay_s": 10,
            "downscale_delay_s": 60}
    return AutoscalingConfig(**{**base, **kw})


def load(serving: int = 1, **kw) -> PoolLoad:
    return PoolLoad(serving=serving, blocks_per_worker=BPW, seqs_per_worker=16, **kw)


def rec(lo: PoolLoad, **kw) -> tuple[int, str]:
    r = recommend(lo, cfg(**kw))
    return r.desired, r.reason


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ---- what the load wants ----------------------------------------------------------------------
@pytest.mark.parametrize("lo, want", [
    # device KV full, nothing parked or waiting: 0.95 >= 0.9 is pressure
    (load(kv_blocks_used=95, running=4, inflight=4), (2, "kv_pressure")),
    # device KV merely 60 % used, but parked streams need 40 more blocks: demand 1.0
    (load(kv_blocks_used=60, parked_blocks=40, parked=3, running=2, inflight=5),
     (2, "kv_pressure")),
    # the same device use without parked streams is no pressure
    (load(kv_blocks_used=60, running=2, inflight=2), (1, "steady")),
    # 2 workers, demand 350 blocks: sized for 0.7 use -> 5, one step -> 3
    (load(2, kv_blocks_used=190, parked_blocks=160, parked=8, running=8, inflight=16),
     (3, "kv_pressure")),
    # waiting requests: 5 per worker
    (load(2, kv_blocks_used=40, waiting=10, running=4, inflight=14), (3, "queue")),
    (load(2, kv_blocks_used=40, waiting=9, running=4, inflight=13), (2, "steady")),
])
def test_up_signals(lo, want):
    assert rec(lo) == want


def test_the_step_bounds_an_upscale_and_the_maximum_caps_it():
    lo = load(1, kv_blocks_used=100, parked_blocks=400, parked=20, running=4, inflight=24)
    assert rec(lo) == (2, "kv_pressure")  # one step
    assert rec(lo, max_step=3) == (4, "kv_pressure")  # 500/70 = 8 wanted, 3 steps
    assert rec(lo, max_step=10) == (4, "kv_pressure")  # capped at max_workers
    full = load(4, kv_blocks_used=400, parked_blocks=400, parked=20)
    assert rec(full) == (4, "steady")  # at the maximum: no higher


def test_starting_workers_count_as_capacity():
    # one worker parks: 1.6 workers' demand, and a second one is already starting
    lo = load(1, starting=1, kv_blocks_used=100, parked_blocks=60, parked=4, running=4,
              inflight=8)
    assert rec(lo) == (2, "steady")
    # (without the starting one it wants one more)
    assert rec(load(1, kv_blocks_used=100, parked_blocks=60, parked=4, running=4,
                    inflight=8)) == (2, "kv_pressure")
    # still more than the two hold: a third
    lo = load(1, starting=1, kv_blocks_used=100, parked_blocks=150, parked=9, running=4)
    assert rec(lo) == (3, "kv_pressure")
    # a TTFT over its target does not add workers while one starts (TTFT lags)
    slow = load(1, starting=1, kv_blocks_used=10, running=1, inflight=1, ttft_p90_s=9.0)
    assert rec(slow, upscale_ttft_s=2.0) == (2, "steady")
    assert rec(load(1, kv_blocks_used=10, running=1, inflight=1, ttft_p90_s=9.0),
               upscale_ttft_s=2.0) == (2, "ttft")
    # without a target TTFT is not a signal
    assert rec(load(1, kv_blocks_used=10, running=1, inflight=1, ttft_p90_s=9.0)) == (1, "steady")


def test_a_pool_without_a_known_size_is_judged_by_its_queue():
    lo = PoolLoad(serving=1, waiting=6, inflight=6)
    assert lo.kv_use() is None
    assert recommend(lo, cfg()).reason == "queue"


@pytest.mark.parametrize("lo, want", [
    # demand 90 blocks: on one worker fewer 0.45 <= 0.5
    (load(3, kv_blocks_used=90, running=3, inflight=3), (2, "low_load")),
    # 110 blocks would be 0.55 on 2: stays
    (load(3, kv_blocks_used=110, running=3, inflight=3), (3, "steady")),
    # parked streams count on the way down too
    (load(3, kv_blocks_used=60, parked_blocks=50, parked=2, running=2, inflight=4),
     (3, "steady")),
    # anything waiting: no downscale
    (load(3, kv_blocks_used=10, waiting=1, running=1, inflight=2), (3, "steady")),
    # a worker starting or draining: no downscale (one change at a time)
    (load(2, starting=1, kv_blocks_used=10, running=1, inflight=1), (3, "steady")),
    (load(3, draining=1, kv_blocks_used=10, running=1, inflight=1), (3, "steady")),
    # batch slots: 30 streams on 2 workers of 16 = 0.94 > 0.5
    (load(3, kv_blocks_used=60, running=30, inflight=30), (3, "steady")),
    # idle: down by one
    (load(3), (2, "idle")),
    # one worker with load: never below one that way
    (load(1, kv_blocks_used=5, running=1, inflight=1), (1, "steady")),
])
def test_down_signals(lo, want):
    assert rec(lo) == want


def test_down_needs_the_ttft_well_under_its_target():
    lo = load(2, kv_blocks_used=20, running=2, inflight=2, ttft_p90_s=1.5)
    assert rec(lo, upscale_ttft_s=2.0) == (2, "steady")  # 1.5 >= 2 * 0.5/0.9
    assert rec(lo.__class__(**{**lo.__dict__, "ttft_p90_s": 0.5}), upscale_ttft_s=2.0) == (
        1, "low_load")


def test_bounds_and_zero():
    assert rec(load(1), min_workers=2) == (2, "below_min")
    assert rec(load(5), max_workers=3) == (3, "above_max")
    assert rec(load(1), min_workers=0) == (0, "idle")  # an idle last worker may go
    assert rec(load(1), min_workers=1) == (1, "steady")
    assert rec(PoolLoad(serving=0), min_workers=0) == (0, "steady")
    assert rec(PoolLoad(serving=0, queued=3), min_workers=0) == (1, "no_worker")
    # a worker already starting for them: nothing more
    assert rec(PoolLoad(serving=0, starting=1, queued=3), min_workers=0) == (1, "steady")
    # below the minimum the whole way at once, whatever the step
    assert rec(PoolLoad(serving=0), min_workers=3, max_step=1) == (3, "below_min")


@pytest.mark.parametrize("kw, msg", [
    ({"min_workers": 3, "max_workers": 2}, "min_workers (3) must not exceed max_workers (2)"),
    ({"min_workers": -1}, "min_workers must be >= 0"),
    ({"max_workers": 0, "min_workers": 0}, "max_workers must be >= 1"),
    ({"upscale_kv_use": 0.5, "downscale_kv_use": 0.6}, "0 < downscale_kv_use < upscale_kv_use"),
    ({"upscale_kv_use": 1.2}, "upscale_kv_use <= 1"),
    ({"upscale_delay_s": -1}, "upscale_delay_s must be >= 0"),
    ({"downscale_to_zero_delay_s": -1}, "downscale_to_zero_delay_s must be >= 0"),
    ({"max_step": 0}, "max_step must be >= 1"),
    ({"queue_timeout_s": 0}, "queue_timeout_s must be > 0"),
    ({"upscale_ttft_s": 0}, "upscale_ttft_s must be > 0"),
])
def test_bad_settings_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        cfg(**kw).check()


# ---- delays -----------------------------------------------------------------------------------
PRESSURE = load(1, kv_blocks_used=100, parked_blocks=50, parked=3, running=4, inflight=7)
CALM = load(1, kv_blocks_used=30, running=2, inflight=2)


def test_an_upscale_waits_for_its_delay_and_the_streak_restarts_after_it():
    clock = Clock()
    a = Autoscaler(cfg(), clock)
    assert a.step(PRESSURE) is None
    assert a.pending() == {"direction": "up", "reason": "kv_pressure", "in_s": 10.0}
    clock.t += 9.9
    assert a.step(PRESSURE) is None
    clock.t += 0.1
    d = a.step(PRESSURE)
    assert (d.direction, d.reason, d.current, d.desired) == ("up", "kv_pressure", 1, 2)
    assert d.pressure_s == pytest.approx(10.0)
    assert a.pending() is None
    # the next change needs a whole delay again
    two = load(2, kv_blocks_used=200, parked_blocks=100, parked=6, running=8)
    clock.t += 1
    assert a.step(two) is None
    clock.t += 9.9
    assert a.step(two) is None
    clock.t += 0.1
    assert a.step(two).desired == 3


def test_a_flapping_load_does_not_flap_the_pool():
    clock = Clock()
    a = Autoscaler(cfg(), clock)
    for _ in range(50):  # pressure for 6 s, calm for 1 s, for 350 s
        for lo, secs in ((PRESSURE, 6), (CALM, 1)):
            for _ in range(secs):
                assert a.step(lo) is None
                clock.t += 1
    assert a.decisions == []
    # down needs a whole downscale delay of low load too
    a2 = Autoscaler(cfg(min_workers=1), clock)
    low = load(2, kv_blocks_used=20, running=2, inflight=2)
    for _ in range(10):  # low for 50 s, then a burst, again and again
        for _ in range(50):
            assert a2.step(low) is None
            clock.t += 1
        assert a2.step(load(2, kv_blocks_used=190, running=8, parked=2, parked_blocks=30)) is None
        clock.t += 1
    assert a2.decisions == []


def test_a_direction_change_resets_the_streak():
    clock = Clock()
    a = Autoscaler(cfg(upscale_delay_s=10, downscale_delay_s=10), clock)
    two = load(2)
    assert a.step(two) is None  # idle: wants down
    clock.t += 8
    assert a.step(load(2, kv_blocks_used=195, running=8)) is None  # now up: a new streak
    clock.t += 8
    assert a.step(two) is None  # down again, from zero
    clock.t += 9
    assert a.step(two) is None
    clock.t += 1
    d = a.step(two)
    assert (d.direction, d.reason, d.desired) == ("down", "idle", 1)
    # a steady reading in between resets it too
    a = Autoscaler(cfg(), clock)
    a.step(PRESSURE)
    clock.t += 9
    a.step(CALM)
    clock.t += 2
    assert a.step(PRESSURE) is None


def test_bounds_and_the_first_worker_from_zero_do_not_wait():
    clock = Clock()
    a = Autoscaler(cfg(min_workers=0, upscale_delay_s=100, downscale_delay_s=100), clock)
    d = a.step(PoolLoad(serving=0, queued=1))
    assert (d.direction, d.reason, d.desired) == ("up", "no_worker", 1)
    assert a.step(load(3)) is None  # idle 3 of at most 4: down, but after the delay
    a = Autoscaler(cfg(max_workers=2, downscale_delay_s=100), clock)
    d = a.step(load(3, kv_blocks_used=200, running=9))
    assert (d.direction, d.reason, d.desired) == ("down", "above_max", 2)
    a = Autoscaler(cfg(min_workers=3, upscale_delay_s=100), clock)
    assert a.step(load(1)).desired == 3


def test_to_zero_has_its_own_delay_where_set():
    clock = Clock()
    a = Autoscaler(cfg(min_workers=0, downscale_delay_s=100, downscale_to_zero_delay_s=5), clock)
    assert a.step(load(1)) is None
    clock.t += 5
    d = a.step(load(1))
    assert (d.direction, d.reason, d.current, d.desired) == ("down", "idle", 1, 0)
    assert a.step(load(2)) is None  # 2 -> 1 waits the whole downscale delay
    clock.t += 99
    assert a.step(load(2)) is None
    clock.t += 1
    assert a.step(load(2)).desired == 1


def test_a_burst_up_and_back_down():
    """A ramp low -> burst -> low through the policy: up by one per delay while the
    pressure lasts, back down one at a time once the load fits fewer workers."""
    clock = Clock()
    a = Autoscaler(cfg(max_workers=3, upscale_delay_s=5, downscale_delay_s=20), clock)
    n, history = 1, []
    demand = [30] * 20 + [400] * 60 + [30] * 120  # blocks, one poll a second
    for blocks in demand:
        used = min(blocks, n * BPW)
        lo = load(n, kv_blocks_used=used, parked_blocks=blocks - used,
                  parked=(blocks - used) // 10, running=max(1, used // 10),
                  inflight=max(1, blocks // 10))
        d = a.step(lo)
        if d is not None:
            n = d.desired
            history.append((d.direction, d.reason, d.desired))
        clock.t += 1
    assert history == [("up", "kv_pressure", 2), ("up", "kv_pressure", 3),
                       ("down", "low_load", 2), ("down", "low_load", 1)]
