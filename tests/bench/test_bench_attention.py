"""`kvserve bench attention` in-process on a tiny geometry: every strategy agrees with the backend."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import pytest
import torch

from kvserve.bench.attention import STRATEGIES, add_parser
from kvserve.workers.model.cpu_kernels import load_paged_decode


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    # the bench sets torch's global thread count; later tests in this process keep theirs
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _run(argv: list[str]) -> int:
    # a parser of our own: the test does not depend on kvserve/bench.py registering the command
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    args = p.parse_args(["attention", *argv])
    return args.func(args)


def test_bench_attention_strategies_agree(tmp_path, capsys, keep_torch_threads) -> None:
    out = tmp_path / "attn.json"
    # 40 and 70 leave partial last blocks; 16-token chunks make 'chunked' merge several per
    # stream; eager flex checks the paged BlockMask/mask_mod without a minute of compiling
    argv = ["--layers", "2", "--batch", "3", "--lengths", "16,40", "--mixed", "8:70",
            "--chunk-tokens", "16", "--flex-eager", "--repeats", "2", "--threads", "1",
            "--json", str(out)]
    with pytest.warns(UserWarning, match="without torch.compile"):
        assert _run(argv) == 0
    report = json.loads(out.read_text())
    assert [w["max_len"] for w in report["workloads"]] == [16, 40, 70]
    for w in report["workloads"]:
        assert w["kv_bytes"] > 0 and w["roofline_ms"] > 0
        assert set(w["results"]) == set(STRATEGIES)
        for name, r in w["results"].items():
            if name == "c_kernel" and load_paged_decode() is None:
                continue  # no compiler here: the row reports that instead of timing SDPA again
            assert "error" not in r, (name, r)
            assert r["max_abs_diff"] <= 1e-5, (w["name"], name)
            assert len(r["samples_ms"]) == 2 and min(r["samples_ms"]) > 0
            assert r["ms_median"] > 0 and r["gbs"] > 0 and r["x_roofline"] > 0
    assert report["machine"]["torch_threads"] == 1
    assert "x roofline" in capsys.readouterr().out


def test_bench_attention_rejects_unknown_strategy(capsys, keep_torch_threads) -> None:
    assert _run(["--strategies", "padded,nope", "--layers", "1", "--batch", "1"]) == 2
    assert "nope" in capsys.readouterr().err
