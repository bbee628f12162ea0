"""`kvserve bench serve --skew/--compare-migration`: the skewed share and argument checks
(no Ray; the migration run itself is the figure in docs/benchmarks.md)."""

from __future__ import annotations

import argparse

from kvserve.bench.serve import add_parser, check_args
from kvserve.bench.serve_dataset import BenchRequest
from kvserve.bench.serve_migration import HOT_SESSION, apply_skew


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
