"""scripts/gpu/quick_summary.py: the quick GPU run's summary from what its steps wrote (sample
logs and JSON in the benches' own shapes): each figure beside its target, met or missed; a
part that wrote nothing is not run; a test run cut short is read from its -v log. Also
scripts/gpu/quick.sh's argument handling and plan (bash only, nothing run)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "quick_summary.py"

ANCHOR = """B=1 context=512: graph 1.288 ms/step = 776 tok/s (0.94 TB/s over 1.21 GB); eager 9.81 ms/step
B=64 context=512: graph 1.752 ms/step = 36,528 tok/s (1.80 TB/s over 3.16 GB); eager 10.02 ms/step
B=256 context=512: graph 3.115 ms/step = 82,188 tok/s (2.57 TB/s over 8.01 GB); eager 11.40 ms/step
B=64 context=2048: graph 2.789 ms/step = 22,947 tok/s (2.58 TB/s over 7.20 GB); eager 11.00 ms/step
"""


def row(b: int, pp: int, s_tg: float) -> dict:
    return {"PP": pp, "TG": 128, "B": b, "N_KV": b * (pp + 128), "T_PP": 1.0, "S_PP": 2e5,
            "T_TG": b * 128 / s_tg, "S_TG": s_tg, "T": 2.0, "S": 1.0, "copy_GBps": 3013.0,
            "ROOF_TG": s_tg * 2, "FRAC_TG": 0.5}


def pressure(host: float, recompute: float, unconstrained: float) -> dict:
    def run(tps: float, **kw) -> dict:
        return {"output_tokens_per_s": tps, "evictions": 9, "restores_copy": 7,
                "restores_recompute": 2, "writebacks_skipped": 0, "tokens_restored_copy": 4000,
                "tokens_recomputed": 900, **kw}

    host_run = run(host, vs_unconstrained=host / unconstrained, vs_recompute=host / recompute,
                   copy_out_gbps=21.5, copy_in_gbps=38.25, copy_out_bytes=9.27e8,
                   copy_in_bytes=8.1e8, restore_decisions={"copy_cheaper_to_copy": 7},
                   cost_model={"host_copy_gbps_d2h": 21.0}, match_unconstrained={"identical": 0, "of": 64})
    return {"workload": {"num_prompts": 64, "input_len": 512, "output_len": 128,
                         "device_fraction": 0.5},
            "runs": {"unconstrained": run(unconstrained, vs_unconstrained=1.0),
                     "recompute": run(recompute, vs_unconstrained=recompute / unconstrained),
                     "host_tier": host_run},
            "restore_vs_recompute": {"tokens": 576, "restore_s_per_token": 2e-6,
                                     "recompute_s_per_token": 5e-6}}


def throughput(tps: float, frac: float) -> dict:
    return {"workload": {"num_seqs": 256, "input_len": "256", "output_len": "128"},
            "kvserve": {"output_tokens_per_s": tps, "roofline_fraction": frac,
                        "roofline_out_tokens_per_s": tps / frac, "copy_gbps": 3013.0}}


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="1" tests="4" time="95.5">
<testcase classname="tests.kvcache.test_block_tables" name="test_join" time="0.1"/>
<testcase classname="tests.workers.test_cuda_path" name="test_async_scheduling_equals_sync" time="9"/>
<testcase classname="tests.workers.test_async_scheduling" name="test_abort_mid_stream" time="3">
<failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.workers.test_cuda_graphs" name="test_padded" time="0">
<skipped message="the GPU test covers this with real graphs"/></testcase>
</testsuite></testsuites>"""


def write(work: Path, files: dict[str, str | dict]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (work / name).write_text(text, encoding="utf-8")


def summarize(tmp_path: Path) -> tuple[str, dict]:
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "work"), str(out)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return (out / "summary.txt").read_text(), json.loads((out / "results.json").read_text())


def line(text: str, start: str) -> str:
    found = [ln for ln in text.splitlines() if ln.startswith(start)]
    assert len(found) == 1, (start, text)
    return found[0]


def test_every_figure_beside_its_target(tmp_path):
    write(tmp_path / "work", {
        "device.txt": "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 1980 MHz;2026-11-28 10:00 UTC, commit abc1234",
        "steps.tsv": "wheels\t0\t4\t60\ntests\t1\t150\t170\nbatched\t0\t61\t110\n",
        "anchor.log": ANCHOR,
        # 0.95x, 0.89x (a miss), 0.91x at ctx 512; 0.81x at 2048
        "batched.json": {"results": [row(1, 512, 737.2), row(64, 512, 32510.0), row(256, 512, 74791.0)]},
        "batched2k.json": {"results": [row(64, 2048, 18587.0)]},
        "pressure.json": pressure(host=11000.0, recompute=10000.0, unconstrained=12000.0),
        "throughput_on.json": throughput(30000.0, 0.30),
        "throughput_off.json": throughput(25000.0, 0.25),
        "tests.xml": JUNIT,
    })
    text, res = summarize(tmp_path)
    assert text.startswith("# kvserve quick GPU run: NVIDIA H100 80GB HBM3")
    assert "wheels 0 4/60s; tests 1 150/170s; batched 0 61/110s" in text
    assert line(text, "| decode S_TG, B=1, ctx 512").endswith("| 0.95x | >= 0.9x | yes |")
    assert "yardstick 776 tok/s (1.288 ms/step)" in line(text, "| decode S_TG, B=1, ctx 512")
    assert line(text, "| decode S_TG, B=64, ctx 512").endswith("| 0.89x | >= 0.9x | **MISS** |")
    assert line(text, "| decode S_TG, B=256, ctx 512").endswith("| 0.91x | >= 0.9x | yes |")
    assert line(text, "| decode S_TG, B=64, ctx 2048").endswith("| 0.81x | >= 0.8x | yes |")
    assert line(text, "| host tier vs unconstrained").endswith("| 0.92x | >= 0.9x | yes |")
    assert line(text, "| host tier vs recompute").endswith("| 1.10x | >= 1.0x | yes |")
    assert line(text, "| LLM.generate").endswith("| 30.0% | >= 35% | **MISS** |")
    tests = line(text, "| CUDA tests")
    assert "2 passed, 1 failed, 1 skipped in 96 s" in tests and tests.endswith("**MISS** |")
    assert line(text, "targets met:") == (
        "targets met: 5 of 8; missed: decode S_TG, B=64, ctx 512; LLM.generate (bench "
        "throughput), async scheduling on; CUDA tests")
    assert "- async scheduling: on 30,000, off 25,000 out tok/s: on/off 1.20x" in text
    assert "- host tier copies: device to host 21.5 GB/s (927 MB), host to device 38.2 GB/s (810 MB)" in text
    assert "- FAILED tests.workers.test_async_scheduling::test_abort_mid_stream" in text
    assert res["anchor"]["64x2048"] == {"ms_per_step": 2.789, "tok_s": 22947.0}
    assert res["targets"]["host tier vs recompute"] is True
    assert res["tests"]["failed"] == ["tests.workers.test_async_scheduling::test_abort_mid_stream"]


def test_what_did_not_run_is_not_run(tmp_path):
    """A run cut after part of the tests: no JUnit report (their -v lines count, and cannot be
    green), no yardstick, no pressure or throughput JSON; a broken JSON counts as none."""
    write(tmp_path / "work", {
        "steps.tsv": "tests\t124\t170\t170\nanchor\tskipped\t0\t0\n",
        "tests.log": "tests/kvcache/test_block_tables.py::test_join PASSED [ 10%]\n"
                     "tests/workers/test_cuda_path.py::test_bf16[x] FAILED [ 20%]\n"
                     "tests/workers/test_cuda_path.py::test_y SKIPPED (needs a CUDA GPU) [ 30%]\n",
        "batched.json": {"results": [row(1, 512, 700.0)]},
        "pressure.json": "{not json",
    })
    text, res = summarize(tmp_path)
    assert "device: not recorded" in text
    assert line(text, "| decode S_TG, B=1, ctx 512").endswith("| yardstick not run |  | >= 0.9x | not run |")
    assert line(text, "| decode S_TG, B=64, ctx 512").startswith("| decode S_TG, B=64, ctx 512 | not run |")
    assert line(text, "| host tier vs unconstrained").endswith("| not run |")
    assert line(text, "| LLM.generate").endswith("| not run |")
    tests = line(text, "| CUDA tests")
    assert "1 passed, 1 failed, 1 skipped | tests.log (no JUnit report: cut short?)" in tests
    assert tests.endswith("**MISS** |")
    assert line(text, "targets met:").startswith("targets met: 0 of 8; missed: CUDA tests; not run: ")
    assert res["pressure"] is None and res["steps"][1]["rc"] == "skipped"


def test_a_cpu_throughput_has_no_roofline(tmp_path):
    write(tmp_path / "work", {"throughput_on.json": {
        "workload": {"num_seqs": 4, "input_len": "16", "output_len": "8"},
        "kvserve": {"output_tokens_per_s": 12.5}}})
    text, _ = summarize(tmp_path)
    assert "| 12.5 out tok/s (no roofline: not CUDA) |" in line(text, "| LLM.generate")
    assert line(text, "| LLM.generate").endswith("| not run |")


def quick(*args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "QUICK_WHEELS": "/nonexistent", **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "run.sh"), "quick", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_quick_plan_and_unknown_steps():
    plan = quick("plan")
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    assert [ln.split(" ", 1)[0] for ln in lines[:-1]] == [
        "wheels", "models", "models_l1b", "tests", "anchor", "batched", "batched2k", "pressure",
        "throughput_on", "throughput_off"]
    tests = next(ln for ln in lines if ln.startswith("tests "))
    assert tests.startswith("tests (timeout 170 s): ")
    for f in ("test_block_tables", "test_host_copies", "test_cuda_path", "test_async_scheduling",
              "test_restore_policy", "test_cuda_graphs", "test_triton_attention"):
        assert f"{f}.py" in tests
    assert "--npp 512 --ntg 128 --npl 1\\,64\\,256" in next(ln for ln in lines if ln.startswith("batched "))
    assert lines[-1] == "timeouts add up to 820 s; the budget is 480 s (the last parts get what is left)"
    bad = quick("tests", "bogus")
    assert bad.returncode == 2 and "unknown step 'bogus'" in bad.stderr


def test_a_spent_budget_skips_the_parts_and_still_summarizes(tmp_path):
    """The dry run with a budget below the summary's reserve: every part asked for is skipped,
    recorded as such, and the summary says they did not run."""
    out, work = tmp_path / "out", tmp_path / "work"
    res = quick("anchor", "batched", QUICK_DRY="1", QUICK_BUDGET="5", PY=sys.executable,
                OUT=str(out), QUICK_WORK=str(work), MODELS=str(tmp_path / "models"))
    assert res.returncode == 0, res.stderr
    assert (work / "steps.tsv").read_text().split() == [
        "anchor", "skipped", "0", "0", "batched", "skipped", "0", "0", "batched2k", "skipped", "0", "0"]
    text = (out / "summary.txt").read_text()
    assert text.startswith("# kvserve quick GPU run: no GPU (dry run on ")
    assert "anchor skipped 0/0s; batched skipped 0/0s; batched2k skipped 0/0s" in text
    assert line(text, "targets met:").startswith("targets met: 0 of 8; not run: decode S_TG, B=1")
    assert re.search(r"^=== anchor: skipped, -\d+ s left of the budget$",
                     (out / "quick.log").read_text(), re.M)
    assert text in res.stdout
