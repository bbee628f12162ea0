"""`kvserve bench lora` in-process on a tiny model: its figures and JSON."""

from __future__ import annotations

import json

import torch
from tiny_models import tiny_model_path

from kvserve.cli import main


def test_bench_lora_json(tmp_path, tmp_path_factory, capsys) -> None:
    n = torch.get_num_threads()
    out = tmp_path / "lora.json"
    try:
        argv = ["bench", "lora", "--model", tiny_model_path(tmp_path_factory), "--adapters",
                "1,3", "--rank", "4", "--streams", "3", "--prompt-len", "8", "--tokens", "4",
                "--swaps", "2", "--repeat", "2", "--threads", "1", "--json", str(out)]
        assert main(argv) == 0
    finally:
        torch.set_num_threads(n)
    r = json.loads(out.read_text())
    assert [row["adapters"] for row in r["throughput"]] == [0, 1, 3]
    assert all(row["tokens_per_s"] == max(row["rounds_tokens_per_s"]) > 0
               and len(row["rounds_tokens_per_s"]) == 2 for row in r["throughput"])
    assert "overhead_cpu_pct" in r["throughput"][1] and "overhead_pct" not in r["throughput"][0]
    assert r["swap"]["host_ms"] > 0 and r["swap"]["disk_ms"] > 0
    assert r["adapter_bytes"] > 0 and r["slot_bytes"] >= 3 * r["adapter_bytes"]
    assert "from host memory" in capsys.readouterr().out
