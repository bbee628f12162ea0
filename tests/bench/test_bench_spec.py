"""`kvserve bench spec` in-process on a tiny model: both engines give the same tokens, and the
report carries the figures the benchmark table takes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from tiny_models import tiny_model_path

from kvserve.bench.spec import WORKLOADS, calls
from kvserve.cli import main


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_unknown_workload_is_refused(capsys) -> None:
    assert main(["bench", "spec", "--workloads", "copy,prose"]) == 2
    assert "unknown workload 'prose'" in capsys.readouterr().err


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("batch", [1, 4, 8, 32])
def test_every_batch_size_runs_every_prompt_in_calls_of_that_size(workload, batch) -> None:
    got = calls(workload, batch)
    n = max(batch, len(WORKLOADS[workload]))
    assert [len(c) for c in got] == [batch] * (n // batch) + ([n % batch] if n % batch else [])
    texts = [conv[0]["content"] for c in got for conv in c]
    assert len(set(texts)) == n  # each with its own numbers
    for i, base in enumerate(WORKLOADS[workload]):  # batch 1 is not its first prompt alone
        assert texts[i] == base.format(n=3 + i, m=40 + 7 * i)


@pytest.mark.slow
def test_bench_spec_json(tmp_path, tmp_path_factory, capsys, keep_torch_threads) -> None:
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--model", tiny_model_path(tmp_path_factory), "--batch", "1,2",
            "--max-tokens", "6", "--threads", "1", "--always", "--rounds", "2", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["speculative_config"]["method"] == "ngram" and report["always"] is True
    rows = report["rows"]
    assert [(r["workload"], r["batch"]) for r in rows] == [
        ("copy", 1), ("copy", 2), ("chat", 1), ("chat", 2)]
    for r in rows:
        # greedy: the same tokens either way, for every prompt of the workload
        assert r["identical"] == r["of"] == len(WORKLOADS[r["workload"]])
        assert r["off_tok_s"] > 0 and r["on_tok_s"] > 0
        assert r["rounds"] == 2 and len(r["round_ratios"]) == 2
        assert 0 <= r["acceptance_rate"] <= 1
    assert "on/off" in capsys.readouterr().out
