"""scripts/gpu/profile_engine.py runs on the CPU with a tiny model: each workload prints its
steps by kind, the host phase table and (when asked) the profiler's table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_model_path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "profile_engine.py"


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


def run(*args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, str(SCRIPT), *args, "--threads", "1"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def phases(text: str) -> dict[str, int]:
    """phase -> calls, from the host phase table."""
    rows = re.findall(r"^(\S.*?)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+%$", text, re.M)
    return {name.strip(): int(calls) for name, calls in rows}


def test_decode_with_profiler(path, tmp_path):
    trace = tmp_path / "trace.json"
    text = run(path, "3", "--steps", "4", "--input-len", "12", "--trace", str(trace))
    assert re.search(r"^engine B=3: [\d.]+ ms/step decode$", text, re.M)
    assert "steps: {'decode, eager': 4}" in text  # the timed steps only, no graphs on the CPU
    calls = phases(text)
    assert calls["scheduler.schedule (with reserve)"] == 4 and calls["sampler"] == 4
    assert calls["append tokens, stops, detok, outputs"] == 4
    assert "under torch.profiler" in text and "Self CPU time total" in text
    assert trace.stat().st_size > 0


def test_generate_and_pressure(path):
    text = run(path, "--workload", "generate", "--num-prompts", "6", "--input-len", "20",
               "--output-len", "5", "--no-profiler", "--async-scheduling", "on")
    assert "async scheduling on" in text
    assert re.search(r"^generate: 6 x 20 -> 5: [\d.]+ s", text, re.M)
    assert "with prompt tokens, eager" in text and "wait for sampled ids (sync)" in phases(text)
    # 8 streams of 24 + 16 tokens (3 blocks each) in a pool of 10 blocks: they must take turns
    text = run(path, "--workload", "pressure", "--num-prompts", "8", "--input-len", "24",
               "--output-len", "16", "--no-profiler", "--host-gib", "0.01")
    evictions = int(re.search(r"evictions (\d+)", text).group(1))
    assert evictions > 0 and "scheduler.park (evictions, write-back)" in phases(text)
