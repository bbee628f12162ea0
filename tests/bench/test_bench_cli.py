"""`kvserve bench offline` run in-process on a tiny workload (no transformers baseline)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from kvserve.bench.common import identical, random_prompts
from kvserve.cli import main


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    # the bench sets torch's global thread count; later tests in this process keep theirs
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_bench_offline_json(tmp_path, capsys, keep_torch_threads) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "offline", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
            "--threads", "1", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    kv = report["kvserve"]
    assert kv["requests"] == 2
    assert kv["input_tokens"] == 16
    assert kv["output_tokens"] == 8  # EOS ignored: exactly output-len tokens per request
    assert kv["elapsed_s"] > 0
    assert kv["output_tokens_per_s"] > 0
    assert kv["total_tokens_per_s"] > kv["output_tokens_per_s"]
    assert kv["cached_prompt_tokens"] == 0  # the warm-up must not pre-fill the prefix cache
    assert 0 <= kv["prefill_s"] <= kv["elapsed_s"]
    assert report["baselines"] == {}
    assert report["machine"]["torch_threads"] == 1
    assert report["machine"]["cores"] >= 1
    assert "out tok/s" in capsys.readouterr().out


def test_random_prompts_are_seeded_and_avoid_special_tokens() -> None:
    a = random_prompts(3, 50, 49152, seed=0)
    assert a == random_prompts(3, 50, 49152, seed=0)
    assert a != random_prompts(3, 50, 49152, seed=1)
    assert all(len(p) == 50 and all(100 <= t < 49152 - 100 for t in p) for p in a)


def test_identical_counts_sequences_and_common_prefixes() -> None:
    r = identical([[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 9, 3]])
    assert r == {"identical": 1, "of": 2, "mean_common_prefix": 2.0}


@pytest.mark.slow
def test_bench_throughput_against_hf_continuous(tmp_path, capsys, keep_torch_threads) -> None:
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--num-seqs", "3", "--input-len", "8:20", "--output-len", "3:9",
            "--baseline", "hf", "--threads", "1", "--no-progress", "--json", str(out),
            "--cpu-matmul", "exact"]  # float32 activations: transformers' greedy tokens
    assert main(argv) == 0
    report = json.loads(out.read_text())
    kv, hf = report["kvserve"], report["baselines"]["hf_continuous"]
    assert "error" not in hf, hf
    assert kv["requests"] == hf["requests"] == 3
    assert kv["input_tokens"] == hf["input_tokens"]
    assert 3 * 3 <= kv["output_tokens"] <= 3 * 9
    assert kv["output_tokens"] == hf["output_tokens"]  # per-request lengths honoured on both sides
    assert hf["kvserve_match"]["identical"] == 3  # same greedy tokens as transformers
    assert hf["speedup_kvserve"] == pytest.approx(
        kv["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert report["workload"]["gflop"] > 0 and kv["gflops"] > 0
    assert "kvserve x" in capsys.readouterr().out


def test_bench_throughput_workload_and_ranges() -> None:
    from kvserve.bench.throughput import make_workload, parse_range

    assert parse_range("32:256") == (32, 256)
    assert parse_range("7") == (7, 7)
    for bad in ("0:4", "9:3", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError):
            parse_range(bad)
    prompts, outs = make_workload(50, (4, 9), (2, 5), 49152, seed=3)
    assert (prompts, outs) == make_workload(50, (4, 9), (2, 5), 49152, seed=3)
    assert all(4 <= len(p) <= 9 for p in prompts) and all(2 <= n <= 5 for n in outs)
    assert len({len(p) for p in prompts}) > 1  # lengths really vary


def test_bench_throughput_rejects_bad_ranges(capsys) -> None:
    assert main(["bench", "throughput", "--input-len", "5:2"]) == 2
    assert "LO <= HI" in capsys.readouterr().err


def test_bench_hoststep_json(tmp_path, capsys, keep_torch_threads) -> None:
    out = tmp_path / "host.json"
    argv = ["bench", "hoststep", "--batch", "3", "--input-len", "8", "--steps", "3",
            "--json", str(out)]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["batch"] == 3 and row["steps"] == 3
    assert 0 < row["cpu_ms_min"] <= row["cpu_ms_median"]
    assert 0 < row["wall_ms_min"] <= row["wall_ms_median"]
    assert row["cpu_us_per_stream"] == pytest.approx(row["cpu_ms_median"] * 1e3 / 3)
    assert "CPU us/stream" in capsys.readouterr().out
    assert main(["bench", "hoststep", "--batch", "0"]) == 2
