"""`kvserve bench serve --skew/--compare-migration`: the skewed share, the alternating pass
order, the per-configuration summary and argument checks (no Ray; the migration run itself
is the figure in docs/benchmarks.md)."""

from __future__ import annotations

import argparse

from kvserve.bench.serve import add_parser, check_args
from kvserve.bench.serve_dataset import BenchRequest
from kvserve.bench.serve_metrics import RequestResult
from kvserve.bench.serve_migration import (
    HOT_SESSION,
    OFF,
    ON,
    apply_skew,
    format_summary,
    pass_order,
    summarize,
)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_skew_pins_that_share_of_requests_to_one_session():
    reqs = [BenchRequest(f"p{i}", [i], 4) for i in range(40)]
    out = apply_skew(reqs, 0.75, seed=3)
    hot = [r for r in out if r.session_id == HOT_SESSION]
    assert len(hot) == 30 and all(r.session_id is None for r in out if r not in hot)
    again = apply_skew([BenchRequest(f"p{i}", [i], 4) for i in range(40)], 0.75, seed=3)
    assert [r.session_id for r in again] == [r.session_id for r in out]  # seeded
    assert all(r.session_id is None for r in apply_skew(
        [BenchRequest("p", [1], 4)], 0.0, seed=3))


def test_migration_arguments_are_checked():
    assert check_args(_args("--skew", "0.5", "--workers", "2", "--compare-migration")) is None
    assert "--skew" in check_args(_args("--skew", "1.5"))
    assert "--workers" in check_args(_args("--workers", "0"))
    assert "self-started" in check_args(_args("--compare-migration", "--host", "h"))
    assert "self-started" in check_args(_args("--compare-migration", "--target", "engine"))


def test_passes_alternate_in_mirrored_rounds():
    assert pass_order(1) == [ON, OFF]
    assert pass_order(2) == [ON, OFF, OFF, ON]
    assert pass_order(3) == [ON, OFF, OFF, ON, ON, OFF]
    for n in (2, 4):  # each configuration's mean position is the same
        order = pass_order(n)
        assert sum(i for i, m in enumerate(order) if m == ON) == \
            sum(i for i, m in enumerate(order) if m == OFF)


def test_summary_per_configuration():
    def one(mode: str, tput: float, ttfts: list[float], moved: int) -> dict:
        return {"mode": mode, "moved": moved, "duration": 10.0, "output_throughput": tput,
                "ttft_p50_ms": 0.0, "ttft_p99_ms": 0.0,
                "results": [RequestResult(success=True, ttft=t) for t in ttfts]
                + [RequestResult(success=False, ttft=99.0)]}

    passes = [one(ON, 40.0, [1.0, 2.0], 3), one(OFF, 50.0, [3.0], 0),
              one(OFF, 56.0, [5.0], 0), one(ON, 44.0, [3.0, 4.0], 2)]
    s = summarize(passes)
    assert s[ON]["passes"] == 2 and s[ON]["streams_moved"] == 5
    assert s[ON]["output_throughput_mean"] == 42.0 and s[OFF]["output_throughput_median"] == 53.0
    assert s[ON]["ttft_p50_ms"] == 2500.0 and s[OFF]["ttft_p50_ms"] == 4000.0  # failed: left out
    text = format_summary(passes, s)
    assert "pass order: 1. migration on, 2. migration off, 3. migration off, 4. migration on" \
        in text


def test_migration_rounds_are_checked():
    assert "--migration-rounds" in check_args(_args("--migration-rounds", "0"))
