"""`kvserve bench migrate`: one stream moved live and one by snapshot on a service the bench
starts in its own process and Ray (this session's Ray may be up already)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # a service of its own: ~1 min on the 2-core host
def test_bench_migrate_moves_a_stream_each_way_and_reports_it(tmp_path):
    out = tmp_path / "migrate.json"
    r = subprocess.run([
        sys.executable, "-m", "kvserve.cli", "bench", "migrate", "--contexts", "64",
        "--rounds", "1", "--before", "8", "--after", "4", "--kv-cache-tokens", "1024",
        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    saved = json.loads(out.read_text())
    moves = {m["method"]: m for m in saved["moves"]}
    assert set(moves) == {"live", "snapshot"}  # the service moved each as asked
    for m in moves.values():
        assert m["context"] == 64 and m["bytes"] > 0 and m["client_stall_ms"] > 0
        assert m["step_ms"] > 0 and m["server_stall_ms"] >= 0
    assert moves["live"]["rounds"] >= 2  # at least one pre-copy round and the final stage
    assert moves["snapshot"]["rounds"] == 1
    assert [(t["context"], t["method"]) for t in saved["table"]] == [(64, "live"),
                                                                        (64, "snapshot")]
    assert "| 64 | live |" in r.stdout
