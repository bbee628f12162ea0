"""`kvserve bench tp` on a tiny model at sizes 1 and 2: figures per size and batch, the
collectives of the size-2 engine, the same greedy tokens, no rank left behind."""

from __future__ import annotations

import json

import psutil
import torch
from tiny_models import tiny_model_path

from kvserve.cli import main


def test_bench_tp_json(tmp_path, tmp_path_factory, capsys) -> None:
    threads = torch.get_num_threads()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "tp.json"
    argv = ["bench", "tp", "--model", tiny_model_path(tmp_path_factory), "--sizes", "1,2",
            "--batch", "2", "--input-len", "8", "--steps", "3", "--json", str(out)]
    try:
        assert main(argv) == 0  # 1 when a size's tokens differ
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.read_text())["results"]
    assert [(r["size"], r["batch"]) for r in rows] == [(1, 2), (2, 2)]
    assert all(r["same_tokens"] and r["steps"] == 3 and r["step_ms_median"] > 0 for r in rows)
    one, two = rows
    assert one["collectives_per_step"] == 0
    # two all-reduces per layer (2 layers), the embedding's, the LM head's gather
    assert two["collectives_per_step"] == 2 * 2 + 2 and two["collective_kib_per_step"] > 0
    assert "same" in capsys.readouterr().out
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
