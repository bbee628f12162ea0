"""`kvserve bench moe` in-process on a tiny layer: the grouped experts and the per-token loop
agree, and every point has its figures."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import pytest
import torch

from kvserve.bench.moe import add_parser


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    args = p.parse_args(["moe", *argv])
    return args.func(args)


def test_bench_moe_paths_agree(tmp_path, capsys, keep_torch_threads) -> None:
    out = tmp_path / "moe.json"
    argv = ["--experts", "6", "--top-k", "2", "--hidden", "32", "--width", "16",
            "--tokens", "1,5,40", "--repeats", "2", "--threads", "1", "--json", str(out)]
    assert _run(argv) == 0
    report = json.loads(out.read_text())
    assert [p["tokens"] for p in report["points"]] == [1, 5, 40]
    for p in report["points"]:
        assert 1 <= p["active_experts"] <= 6
        assert set(p["results"]) == {"grouped", "per_token"}
        for r in p["results"].values():
            assert r["max_abs_diff"] <= 1e-5 and r["ms_median"] > 0 and r["tokens_per_s"] > 0
    assert "grouped x per_token" in capsys.readouterr().out


def test_bench_moe_rejects_bad_arguments(capsys, keep_torch_threads) -> None:
    assert _run(["--experts", "4", "--top-k", "5"]) == 2
    assert "--top-k" in capsys.readouterr().err
