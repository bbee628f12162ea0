"""`kvserve bench serve`: metric math and arrivals on synthetic timings, the workload, and
short end-to-end runs against the in-process engine and the session service (gRPC, HTTP)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import numpy as np
import pytest

from kvserve.bench.serve_dataset import (
    BenchRequest,
    arrival_offsets,
    prefix_repetition_dataset,
    random_dataset,
    sample_lens,
)
from kvserve.bench.serve_metrics import (
    RequestResult,
    compare,
    compute_metrics,
    format_block,
    meets_slos,
    parse_goodput,
)


def _res(ttft: float, itl: list[float], out: int | None = None, prompt: int = 10) -> RequestResult:
    """A completed request whose chunks came after `ttft` then `itl` gaps (one token each)."""
    n = len(itl) + 1 if out is None else out
    return RequestResult(success=True, prompt_len=prompt, output_len=n, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl))


# ---- metric math -----------------------------------------------------------------------------
def test_tpot_excludes_the_first_token():
    r = _res(0.5, [0.1, 0.2, 0.3])  # 4 tokens, e2el 1.1 s
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert _res(0.5, [], out=1).tpot is None  # one token: no TPOT


def test_itl_counts_chunks_tpot_counts_tokens():
    # 2 chunks after the first, 8 tokens in all: ITL sees 2 gaps, TPOT spreads over 7 tokens
    r = _res(0.2, [0.35, 0.35], out=8)
    m = compute_metrics([r], duration=1.0)
    assert m["mean_itl_ms"] == pytest.approx(350.0)
    assert m["mean_tpot_ms"] == pytest.approx(700.0 / 7)


def test_compute_metrics_totals_and_percentiles():
    results = [_res(t, [0.01] * 9, prompt=100) for t in (0.1, 0.2, 0.3, 0.4)]
    results.append(RequestResult(success=False, prompt_len=100, error="boom"))
    m = compute_metrics(results, duration=2.0, percentiles=(50, 99))
    assert (m["completed"], m["failed"]) == (4, 1)
    assert m["total_input_tokens"] == 400 and m["total_output_tokens"] == 40  # failures excluded
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(20.0)
    assert m["total_token_throughput"] == pytest.approx(220.0)
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["median_ttft_ms"] == pytest.approx(250.0)
    assert m["p50_ttft_ms"] == pytest.approx(250.0)
    # linear interpolation between the 3rd and 4th of 4 values, as numpy (and vLLM) do
    assert m["p99_ttft_ms"] == pytest.approx(300.0 + 0.97 * 100.0)
    assert m["mean_itl_ms"] == pytest.approx(10.0) and m["p99_itl_ms"] == pytest.approx(10.0)
    assert m["mean_e2el_ms"] == pytest.approx(250.0 + 90.0)


def test_no_successes_gives_zero_latencies_not_nan():
    m = compute_metrics([RequestResult(error="x")], duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
    with pytest.raises(ValueError):
        compute_metrics([], duration=0.0)


def test_goodput_counts_requests_within_every_slo():
    fast = _res(0.05, [0.01] * 10)  # ttft 50 ms, tpot 10 ms, e2el 150 ms
    slow_first = _res(0.5, [0.01] * 10)  # ttft 500 ms
    slow_decode = _res(0.05, [0.2] * 10)  # tpot 200 ms
    slos = parse_goodput(["ttft:100", "tpot:50"])
    assert slos == {"ttft": 100.0, "tpot": 50.0}
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_decode)] == [True, False, False]
    m = compute_metrics([fast, slow_first, slow_decode], duration=2.0, slos=slos)
    assert m["request_goodput"] == pytest.approx(0.5)
    assert meets_slos(_res(0.05, [0.01]), {"e2el": 61.0}) and not meets_slos(
        _res(0.05, [0.02]), {"e2el": 60.0})


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:abc", "tpot:-1", "e2el:nan"])
def test_parse_goodput_rejects_bad_slos(bad):
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([bad])


def test_printed_block_and_comparison():
    m = compute_metrics([_res(0.1, [0.02] * 3)], duration=1.0, slos={"ttft": 200.0})
    block = format_block(m, max_concurrency=4)
    for label in ("Successful requests:", "Failed requests:", "Maximum request concurrency:",
                  "Benchmark duration (s):", "Total generated tokens:", "Request goodput (req/s):",
                  "Output token throughput (tok/s):", "Median TTFT (ms):", "P99 TPOT (ms):",
                  "Mean ITL (ms):", "Median E2EL (ms):"):
        assert label in block
    assert "Median TTFT (ms):                       100.00" in block
    base = compute_metrics([_res(0.1, [0.02] * 3)], duration=2.0)
    c = compare(base, m)
    assert c["output_throughput_ratio"] == pytest.approx(2.0)
    assert c["ttft_p50_overhead_ms"] == pytest.approx(0.0)


# ---- arrivals and workload -------------------------------------------------------------------
def test_poisson_arrivals_have_the_requested_rate():
    t = np.array(arrival_offsets(4000, rate=20.0, burstiness=1.0, seed=1))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)  # exponential: CV 1


def test_burstiness_changes_spread_not_rate():
    bursty = np.diff(arrival_offsets(4000, 10.0, 0.25, seed=2))
    even = np.diff(arrival_offsets(4000, 10.0, 4.0, seed=2))
    for gaps in (bursty, even):
        assert gaps.mean() == pytest.approx(0.1, rel=0.1)
    # gamma(k): coefficient of variation 1/sqrt(k)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)
    assert even.std() / even.mean() == pytest.approx(0.5, rel=0.1)
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    assert arrival_offsets(3, 5.0, 1.0, 7) == arrival_offsets(3, 5.0, 1.0, 7)  # seeded
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (math.nan, 1.0)):
        with pytest.raises(ValueError):
            arrival_offsets(3, rate, b, 0)


def test_sample_lens_range():
    rng = np.random.default_rng(0)
    assert sample_lens(5, 100, 0.0, rng) == [100] * 5
    lens = sample_lens(2000, 100, 0.5, rng)
    assert min(lens) == 50 and max(lens) == 150
    with pytest.raises(ValueError):
        sample_lens(1, 10, 1.0, rng)


@pytest.fixture(scope="module")
def tok(smol_path):
    from kvserve.workers.loading.tokenizer import load_tokenizer

    return load_tokenizer(smol_path)


def test_random_prompts_tokenize_to_the_requested_length(tok):
    reqs = random_dataset(tok, 6, 64, 8, 0.0, seed=3)
    assert all(r.prompt_len == 64 and r.output_len == 8 for r in reqs)
    for r in reqs:  # the ids are the server's tokenization of the text sent
        assert tok.encode(r.prompt) == r.prompt_ids
    assert random_dataset(tok, 6, 64, 8, 0.0, seed=3) == reqs
    assert random_dataset(tok, 6, 64, 8, 0.0, seed=4) != reqs


def test_prefix_repetition_shares_prefixes(tok):
    reqs = prefix_repetition_dataset(tok, 8, prefix_len=48, num_prefixes=2, suffix_len=16,
                                     output_len=4, range_ratio=0.0, seed=5)
    heads = {tuple(r.prompt_ids[:40]) for r in reqs}
    assert len(heads) == 2  # two groups, each sharing its prefix tokens
    assert all(60 <= r.prompt_len <= 68 for r in reqs)  # the seam may merge a token or two


# ---- end to end ------------------------------------------------------------------------------
def test_engine_target_runs_the_requests(tok, smol_llm):
    from kvserve.bench.serve import run_requests
    from kvserve.bench.serve_clients import EngineClient
    from kvserve.workers.engine.async_engine import AsyncLLMEngine

    reqs = random_dataset(tok, 3, 24, 5, 0.0, seed=6)

    async def go() -> tuple[list[RequestResult], float]:
        client = EngineClient(smol_llm.engine.config)
        # the session's engine (no second model load); close() stops only the async wrapper
        client.engine = AsyncLLMEngine(engine=smol_llm.engine)
        try:
            return await run_requests(client, reqs, [0.0, 0.0, 0.05], max_concurrency=2)
        finally:
            await client.close()

    results, duration = asyncio.run(go())
    assert all(r.success for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == [5, 5, 5]  # EOS ignored: exactly as asked
    assert all(r.prompt_len == 24 and 0 < r.ttft < r.latency <= duration for r in results)
    assert all(len(r.itl) >= 1 for r in results)


def _bench_cli(args: list[str]) -> int:
    from kvserve.cli import main

    return main(["bench", "serve", *args])


def test_cli_rejects_bad_arguments(capsys):
    for bad in (["--num-prompts", "0"], ["--request-rate", "0"], ["--goodput", "ttft"],
                ["--burstiness", "-1"], ["--target", "engine", "--compare-engine"],
                ["--compare-engine", "--rounds", "0"]):
        assert _bench_cli(bad) == 2
        assert "kvserve bench serve:" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["grpc", "http"])
def test_unreachable_server_is_a_clear_error(target, capsys):
    from kvserve.deploy.serve_stop import free_port

    rc = _bench_cli(["--target", target, "--port", str(free_port()), "--num-prompts", "2",
                     "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and f"kvserve bench serve: {target}: cannot start:" in err
    assert "Traceback" not in err


def test_wrong_api_key_is_a_clear_error(serve_app, capsys):
    rc = _bench_cli(["--target", "grpc", "--port", str(serve_app.grpc_port), "--api-key", "nope",
                     "--num-prompts", "2", "--no-progress"])
    assert rc == 1 and "UNAUTHENTICATED" in capsys.readouterr().err


def _check_saved(path, target: str, n: int) -> None:
    saved = json.loads(path.read_text())
    m = saved["runs"][target]["metrics"]
    assert m["completed"] == n and m["failed"] == 0
    assert m["total_output_tokens"] == n * 4 and m["total_input_tokens"] == n * 32
    assert m["output_throughput"] > 0 and m["median_ttft_ms"] > 0 and m["mean_tpot_ms"] > 0
    assert saved["workload"]["num_prompts"] == n


@pytest.mark.parametrize("target", ["grpc", "http"])
def test_end_to_end_against_the_service(serve_app, target, tmp_path, capsys):
    out = tmp_path / f"{target}.json"
    port = serve_app.grpc_port if target == "grpc" else serve_app.http_port
    rc = _bench_cli([
        "--target", target, "--port", str(port),  # host: 127.0.0.1 when only the port is given
        "--num-prompts", "4", "--random-input-len", "32", "--random-output-len", "4",
        "--request-rate", "20", "--max-concurrency", "2", "--num-warmups", "1",
        "--goodput", "ttft:60000", "--no-progress", "--save-result", str(out),
        *(["--api-key", serve_app.api_key] if getattr(serve_app, "api_key", None) else []),
    ])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert f"Serving Benchmark Result ({target})" in printed
    assert "Successful requests:                    4" in printed
    _check_saved(out, target, 4)
    assert json.loads(out.read_text())["runs"][target]["metrics"]["request_goodput"] > 0


@pytest.mark.slow
def test_compare_workers_resizes_its_own_service_between_passes(tmp_path):
    """--compare-workers on CPU, tiny: one worker, then two (each with half the KV and half
    the cores), in a service the bench starts in its own process and Ray (this session's Ray
    may be up already)."""
    import subprocess
    import sys

    from kvserve.hardware import available_cores

    out = tmp_path / "workers.json"
    r = subprocess.run([
        sys.executable, "-m", "kvserve.cli", "bench", "serve", "--compare-workers",
        "--target", "grpc", "--num-prompts", "4", "--random-input-len", "16",
        "--random-output-len", "4", "--max-concurrency", "4", "--num-warmups", "0",
        "--kv-cache-tokens", "2048", "--rounds", "1", "--no-progress", "--save-result", str(out),
    ], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "2 workers / 1 worker output tok/s (medians):" in r.stdout
    saved = json.loads(out.read_text())
    worker = saved["service_worker_engine"]
    assert worker["kv_cache_tokens"] == 1024 and worker["device"] == "cpu"
    assert worker["num_threads"] == max(1, available_cores() // 2)
    cw = saved["compare_workers"]
    assert cw["order"] == ["1 worker", "2 workers"] and cw["output_throughput_ratio"] > 0
    one, two = cw["passes"]
    assert one["workers_used"] == ["worker-0"]  # worker 0 serves every pass
    assert len(two["workers_used"]) == 2 and "worker-0" in two["workers_used"]
    for run in saved["runs"].values():
        m = run["metrics"]
        assert (m["completed"], m["failed"], m["total_output_tokens"]) == (4, 0, 16)


def test_a_ramp_sends_each_segment_at_its_rate():
    from kvserve.bench.serve_autoscale import parse_ramp, ramp_offsets

    segs = parse_ramp("100:1,100:10,100:0")
    assert segs == [(100.0, 1.0), (100.0, 10.0), (100.0, 0.0)]
    t = np.array(ramp_offsets(segs, 1.0, seed=3))
    assert np.all(np.diff(t) > 0) and t.max() < 200  # the last segment sends nothing
    low, burst = ((t >= a) & (t < b) for a, b in ((0, 100), (100, 200)))
    assert 70 <= low.sum() <= 130 and 900 <= burst.sum() <= 1100
    assert ramp_offsets(segs, 1.0, seed=3) == t.tolist()  # seeded
    for bad in ("10", "10:x", "0:1", "10:-1", "10:0", ""):
        with pytest.raises(ValueError, match="--ramp"):
            parse_ramp(bad)


def test_cli_rejects_bad_autoscaling_runs(capsys):
    for bad, why in ((["--ramp", "10:1,x"], "--ramp takes SECONDS:RATE"),
                     (["--compare-autoscaling"], "needs a --ramp"),
                     (["--compare-autoscaling", "--ramp", "5:1", "--min-workers", "2",
                       "--max-workers", "2"], "compares --min-workers >= 1 with a larger"),
                     (["--compare-autoscaling", "--ramp", "5:1", "--port", "9"],
                      "runs a self-started grpc or http service on its own"),
                     (["--compare-autoscaling", "--ramp", "5:1", "--prefill-workers", "1",
                       "--decode-workers", "1"], "autoscaling works on mixed workers only; ")):
        assert _bench_cli(bad) == 2
        assert why in capsys.readouterr().err


@pytest.mark.slow
def test_compare_autoscaling_runs_a_ramp_on_three_pools(tmp_path):
    """--compare-autoscaling on CPU, tiny: a short ramp through a fixed pool of one, the
    autoscaled pool of one to two, and a fixed pool of two, in a service the bench starts in
    its own process and Ray."""
    import subprocess
    import sys

    out = tmp_path / "autoscale.json"
    r = subprocess.run([
        sys.executable, "-m", "kvserve.cli", "bench", "serve", "--compare-autoscaling",
        "--target", "grpc", "--ramp", "2:2,4:6,2:1", "--random-input-len", "64",
        "--random-output-len", "24", "--num-warmups", "1", "--kv-cache-tokens", "512",
        "--min-workers", "1", "--max-workers", "2", "--upscale-delay-s", "0.5",
        "--downscale-delay-s", "30", "--no-progress", "--save-result", str(out),
    ], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    saved = json.loads(out.read_text())
    ca = saved["compare_autoscaling"]
    assert [p["pass"] for p in ca["passes"]] == ["fixed 1", "autoscaled", "fixed 2"]
    n = saved["workload"]["num_prompts"]
    assert n > 0 and saved["workload"]["ramp"] == "2:2,4:6,2:1"
    for p in ca["passes"]:
        assert (p["completed"], p["failed"]) == (n, 0)  # no request lost
        assert p["worker_seconds"] > 0 and p["ttft_p50_ms"] > 0
    fixed1, auto, fixed2 = ca["passes"]
    assert fixed1["max_workers"] == 1 and fixed2["max_workers"] == 2
    assert fixed2["mean_workers"] > 1.9 and fixed1["mean_workers"] < 1.1
    assert 1 <= auto["max_workers"] <= 2
    for c in auto["cold_starts"]:  # each worker it started, with its times
        assert c["pressure_to_serving_s"] >= c["cold_start_s"] >= c["load_s"] > 0
    assert "pass" in r.stdout and "worker-s" in r.stdout


def test_bench_request_is_plain_data():
    r = BenchRequest("hi", [1, 2], 3)
    assert r.prompt_len == 2


def test_cpu_meter_counts_this_process_as_the_bench():
    import os
    import time

    from kvserve.bench.serve_load import CpuMeter, _tree_cpu

    tree0, cpu0 = _tree_cpu(), time.process_time()
    with CpuMeter() as meter:
        end = time.process_time() + 0.3
        while time.process_time() < end:  # 0.3 CPU seconds, however busy the machine is
            pass
    used = time.process_time() - cpu0
    # children an earlier test left running count too: the meter measures the process tree
    children = sum(t - tree0.get(pid, 0.0) for pid, t in _tree_cpu().items() if pid != os.getpid())
    f = meter.figures
    assert used - 0.06 <= f["bench_cores"] * f["wall_s"] <= used + children + 0.06  # 10 ms ticks
    assert f["other_cores"] >= 0.0
    assert CpuMeter().warning("x") is None  # no figures, no warning


def test_cpu_meter_merges_slices_by_their_wall_time():
    from kvserve.bench.serve_load import CpuMeter

    a, b, empty = CpuMeter(), CpuMeter(), CpuMeter()
    a.figures = {"cores": 2, "wall_s": 1.0, "bench_cores": 2.0, "other_cores": 0.0}
    b.figures = {"cores": 2, "wall_s": 3.0, "bench_cores": 1.0, "other_cores": 0.4}
    m = CpuMeter.merged([a, empty, b]).figures
    assert m["wall_s"] == 4.0 and m["cores"] == 2
    assert m["bench_cores"] == pytest.approx(5.0 / 4.0)  # (2*1 + 1*3) CPU-s over 4 s
    assert m["other_cores"] == pytest.approx(1.2 / 4.0)
    assert CpuMeter.merged([empty]).figures == {}


def test_paused_service_stops_its_processes_and_resumes_them():
    import subprocess

    import psutil

    from kvserve.bench.serve_service import BenchService

    def settled(p: psutil.Process, stopped: bool) -> bool:
        # A signal takes effect when the process next leaves the kernel: one still in exec's
        # disk reads shows 'disk-sleep' for a moment, so wait (bounded) for the state.
        deadline = time.monotonic() + 10
        while (p.status() == psutil.STATUS_STOPPED) != stopped:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    child = subprocess.Popen(["sleep", "30"])  # stands in for the Ray processes: a descendant
    try:
        p = psutil.Process(child.pid)
        with BenchService(1, 2, None).paused():
            assert settled(p, stopped=True)
        assert settled(p, stopped=False)
        with pytest.raises(RuntimeError), BenchService(1, 2, None).paused():
            assert settled(p, stopped=True)
            raise RuntimeError("a failed round")  # the processes go on even then
        assert settled(p, stopped=False)
    finally:
        child.kill()
        child.wait()


def test_interleaved_rounds_alternate_with_the_engine_paused(tok, smol_llm, serve_app):
    """--rounds: every request through both, in slices whose order alternates; only the
    engine's turns run inside pause()."""
    import argparse
    import contextlib

    from kvserve.bench.serve import bench_interleaved
    from kvserve.bench.serve_clients import EngineClient, GrpcClient
    from kvserve.workers.engine.async_engine import AsyncLLMEngine

    state = {"paused": False}
    log: list[tuple[str, bool, int]] = []

    @contextlib.contextmanager
    def pause():
        state["paused"] = True
        try:
            yield
        finally:
            state["paused"] = False

    class Logged:  # records which client sent what, and whether the service was paused
        def __init__(self, inner):
            self.inner, self.name = inner, inner.name

        async def start(self):
            if isinstance(self.inner, EngineClient):  # the session's engine: no second load
                self.inner.engine = AsyncLLMEngine(engine=smol_llm.engine)
            else:
                await self.inner.start()

        async def send(self, req):
            log.append((self.name, state["paused"], req.prompt_len))
            return await self.inner.send(req)

        async def close(self):
            await self.inner.close()

    reqs = random_dataset(tok, 5, 24, 3, 0.0, seed=11)
    warm = random_dataset(tok, 1, 16, 2, 0.0, seed=12)
    key = getattr(serve_app, "api_key", None)
    a = argparse.Namespace(rounds=3, request_rate=math.inf, burstiness=1.0, seed=0,
                           max_concurrency=1, progress=False)
    outcome = asyncio.run(bench_interleaved(
        Logged(EngineClient(smol_llm.engine.config)),
        Logged(GrpcClient("127.0.0.1", serve_app.grpc_port, api_key=key)), reqs, warm, a, pause))
    (eng_res, eng_s, _), (grpc_res, grpc_s, _) = outcome
    assert all(r.success for r in eng_res + grpc_res)
    assert [r.output_len for r in eng_res] == [3] * 5 == [r.output_len for r in grpc_res]
    assert eng_s > 0 and grpc_s > 0
    assert all(paused == (name == "engine") for name, paused, _ in log)
    timed = [name for name, _, n in log if n == 24]
    # slices of 2, 1, 2 requests; the engine goes first in rounds 1 and 3, the target in 2
    assert timed == ["engine"] * 2 + ["grpc"] * 2 + ["grpc", "engine"] + ["engine"] * 2 + ["grpc"] * 2


# ---- disaggregated serving (kvserve.bench.serve_disagg) --------------------------------------
def test_long_short_prompts_mix_long_ones_among_short_ones(tok):
    from kvserve.bench.serve_dataset import long_short_dataset

    reqs = long_short_dataset(tok, 8, short_len=16, long_len=96, long_share=0.25,
                              output_len=4, range_ratio=0.0, seed=2)
    assert sorted(r.prompt_len for r in reqs) == [16] * 6 + [96] * 2
    assert long_short_dataset(tok, 8, 16, 96, 0.25, 4, 0.0, seed=2) == reqs
    with pytest.raises(ValueError, match="--long-share"):
        long_short_dataset(tok, 4, 16, 96, 1.5, 4, 0.0, seed=2)


def test_disagg_summary_and_handoffs_by_prompt_length():
    from kvserve.bench.serve_disagg import by_length, format_summary, summarize

    def res(ttft: float, itl: list[float]) -> RequestResult:
        return RequestResult(success=True, prompt_len=8, output_len=len(itl) + 1, ttft=ttft,
                             itl=itl, latency=ttft + sum(itl))

    passes = [{"mode": "disaggregated", "results": [res(0.2, [0.01, 0.01])],
               "output_throughput": 10.0, "handoffs": 1, "local": 0},
              {"mode": "mixed", "results": [res(0.1, [0.05, 0.03]), RequestResult()],
               "output_throughput": 8.0, "handoffs": 0, "local": 0}]
    s = summarize(passes)
    assert s["disaggregated"]["ttft_p50_ms"] == pytest.approx(200)
    assert s["disaggregated"]["itl_p99_ms"] == pytest.approx(10)
    assert s["mixed"]["itl_p50_ms"] == pytest.approx(40) and s["mixed"]["failed"] == 1
    log = [{"outcome": "moved", "prompt_tokens": 300, "seconds": 0.004, "bytes": 1 << 20},
           {"outcome": "moved", "prompt_tokens": 310, "seconds": 0.006, "bytes": 1 << 20},
           {"outcome": "moved", "prompt_tokens": 2000, "seconds": 0.02, "bytes": 8 << 20},
           {"outcome": "recomputed", "prompt_tokens": 300, "seconds": 0.0, "bytes": 0}]
    rows = by_length(log)
    assert [(r["prompt_tokens"], r["handoffs"]) for r in rows] == [("256-511", 2),
                                                                    ("1024-2047", 1)]
    assert rows[0]["ms_p50"] == pytest.approx(5)
    text = format_summary(s, rows)
    assert "disaggregated" in text and "256-511" in text and "1.00MiB" in text


def test_disagg_bench_arguments_are_checked(capsys):
    for bad, why in ((["--prefill-workers", "1"], "go together"),
                     (["--prefill-workers", "1", "--decode-workers", "1", "--port", "9000"],
                      "self-started"),
                     (["--prefill-workers", "1", "--decode-workers", "1", "--workers", "2"],
                      "self-started"),
                     (["--handoff-sweep", "64"], "need --prefill-workers"),
                     (["--prefill-workers", "1", "--decode-workers", "1", "--handoff-sweep",
                       "64,x"], "--handoff-sweep takes prompt lengths")):
        assert _bench_cli(bad) == 2
        assert why in capsys.readouterr().err


@pytest.mark.slow
def test_disagg_bench_compares_roles_on_its_own_service(tmp_path):
    """--prefill-workers 1 --decode-workers 1 on CPU, tiny: a disaggregated pass and a mixed
    pass of the same two workers, then a hand-off sweep, in a service of its own."""
    import subprocess
    import sys

    out = tmp_path / "disagg.json"
    r = subprocess.run([
        sys.executable, "-m", "kvserve.cli", "bench", "serve", "--prefill-workers", "1",
        "--decode-workers", "1", "--dataset", "long-short", "--random-input-len", "16",
        "--long-input-len", "300", "--long-share", "0.5", "--random-output-len", "8",
        "--num-prompts", "4", "--max-concurrency", "4", "--num-warmups", "0",
        "--disagg-rounds", "1", "--stream-interval-ms", "0", "--handoff-sweep", "64,300",
        "--disagg-min-prompt-tokens", "256",  # the 300-token prompts handed off, not the 16
        "--no-progress", "--save-result", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())["disagg"]
    assert d["order"] == ["disaggregated", "mixed"]
    s = d["summary"]
    assert s["disaggregated"]["handoffs"] == 2 and s["disaggregated"]["local_prefills"] == 2
    assert s["mixed"]["handoffs"] == 0 and s["mixed"]["failed"] == 0
    assert [row["prompt_tokens"] for row in d["sweep"]] == [64, 300]
    assert all(row["handoffs"] == 3 and row["handoff_bytes"] > 0 for row in d["sweep"])
