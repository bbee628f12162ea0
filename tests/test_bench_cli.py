"""`kvserve bench offline` run in-process on a tiny workload (no transformers baseline)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from kvserve.bench import identical, random_prompts
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
