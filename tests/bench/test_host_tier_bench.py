"""`kvserve bench pressure` and `kvserve bench multiturn` run in-process on the tiny model
(no transformers baseline): they finish, print their figures and write consistent JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from tiny_models import tiny_model_path

from kvserve.cli import main


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    n = torch.get_num_threads()  # the benches set torch's global thread count
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


def test_bench_pressure_json(tiny_path, tmp_path, capsys, keep_torch_threads):
    out = tmp_path / "p.json"
    assert main(["bench", "pressure", "--model", tiny_path, "--num-prompts", "8", "--input-len", "24",
                 "--output-len", "16", "--block-size", "4", "--baseline", "none", "--threads", "1",
                 "--restore-policy", "copy", "--rounds", "2",
                 "--no-progress", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    runs = r["runs"]
    assert set(runs) == {"unconstrained", "recompute", "host_tier"}
    assert r["workload"]["device_kv_tokens"] * 2 == r["workload"]["peak_kv_tokens"]
    for name in ("recompute", "host_tier"):
        assert runs[name]["failed"] == 0
        assert runs[name]["match_unconstrained"]["identical"] == 8
        assert runs[name]["output_tokens"] == 8 * 16
    host = runs["host_tier"]
    # two interleaved rounds each, every one from empty caches: the same evictions each time
    assert all(len(x["rounds"]) == 2 for x in runs.values())
    assert [x["evictions"] for x in host["rounds"]] == [host["evictions"]] * 2
    assert host["evictions"] > 0
    assert host["tokens_recomputed"] == 0 < host["tokens_restored_copy"]
    assert runs["recompute"]["tokens_restored_copy"] == 0 < runs["recompute"]["tokens_recomputed"]
    # restored by copy, as the policy says, and the copies' bandwidth each way reported
    assert host["restores_copy"] == host["restore_decisions"]["copy_policy"] > 0
    assert host["copy_out_gbps"] > 0 and host["copy_in_gbps"] > 0
    assert host["cost_model"]["prefill_tokens_per_s"] > 0
    assert r["restore_vs_recompute"]["restore_s_per_token"] > 0
    text = capsys.readouterr().out
    assert "host_tier" in text and "cheaper" in text and "device to host" in text


def test_bench_multiturn_json(tiny_path, tmp_path, capsys, keep_torch_threads):
    out = tmp_path / "m.json"
    assert main(["bench", "multiturn", "--model", tiny_path, "--conversations", "3", "--turns", "3",
                 "--turn-len", "40", "--output-len", "4", "--block-size", "4", "--min-history", "80",
                 "--threads", "1", "--restore-policy", "copy", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["same_outputs"] is True
    assert r["without_host"]["host_prefix_hit_tokens"] == 0
    # by the last turn the other conversations pushed each history off the device: it comes
    # back from host (all its full blocks)
    last = [t for t in r["with_host"]["turns"] if t["turn"] == 2]
    assert len(last) == 3 and all(t["host_hit_tokens"] >= t["history"] - 4 for t in last)
    assert r["with_host"]["long_follow_ups"] == 3
    assert "median TTFT" in capsys.readouterr().out
