"""`kvserve bench matmul` in-process on one small shape: every candidate runs and computes the
same product (within its activation rounding), so its speed is of a right answer."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import pytest
import torch

from kvserve.bench.matmul import add_parser


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    n, engine = torch.get_num_threads(), torch.backends.quantized.engine
    yield
    torch.set_num_threads(n)
    torch.backends.quantized.engine = engine


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    args = p.parse_args(["matmul", *argv])
    return args.func(args)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_bench_matmul_candidates_agree(tmp_path, capsys, keep_torch_threads, qtype: str) -> None:
    out = tmp_path / "mm.json"
    assert _run(["--rows", "1,9", "--shapes", "o", "--qtype", qtype, "--repeat", "1",
                 "--threads", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["M"] for r in rows] == [1, 9]
    for r in rows:
        err = r["rel_err"]
        assert set(r["us"]) == set(err) and all(v > 0 for v in r["us"].values())
        assert err["mkl fp32"] < 1e-5
        assert err["kvserve int8"] < 2e-2  # 8-bit activations per 32 values
        if qtype == "Q4_1":
            assert err["kvserve exact"] < 1e-5
        else:  # the float32-activation kernel takes the 32-weight blocks only
            assert "kvserve exact" not in err
        for eng in ("fbgemm", "onednn"):
            if eng in torch.backends.quantized.supported_engines:
                assert err[f"{eng} int8"] < 1e-1  # 8-bit weights and one scale per row
    assert "kvserve int8" in capsys.readouterr().out
