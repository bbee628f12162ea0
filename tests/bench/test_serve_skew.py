"""`kvserve bench serve --skew/--compare-migration`: the skewed share, the alternating pass
order, the per-configuration summary and argument checks (no Ray; the migration run itself
is the figure in docs/benchmarks.md)."""

from __future__ import annotations

import argparse

from kvserve.bench.serve import add_parser, check_args
from kvserve.bench.serve_dataset import BenchRequest
from kvserve.bench.serve_metrics import RequestResult
from kvserve.bench.serve_migration import (
    HOT_SESSION,
    OFF,
    ON,
    apply_skew,
    format_summary,
    pass_order,
    summarize,
)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_skew_pins_that_share_of_requests_to_one_session():
    reqs = [BenchRequest(f"p{i}", [i], 4) for i in range(40)]
    out = apply_skew(reqs, 0.75, seed=3)
    hot = [r for r in out if r.session_id == HOT_SESSION]
    assert len(hot) == 30 and all(r.session_id is None for r in out if r not in hot)
    again = apply_skew([BenchRequest(f"p{i}", [i], 4) for i in range(40)], 0.75, seed=3)
    assert [r.session_id for r in again] == [r.session_id for r in out]  # seeded
    assert all(r.session_id is None for r in apply_skew(
        [BenchRequest("p", [1], 4)], 0.0, seed=3))


def test_migration_arguments_are_checked():
    assert check_args(_args("--skew", "0.5", "--workers", "2", "--compare-migration")) is None
    assert "--skew" in check_args(_args("--skew", "1.5"))
    assert "--workers" in check_args(_args("--workers", "0"))
    assert "self-started" in check_args(_args("--compare-migration", "--host", "h"))
    assert "self-started" in check_args(_args("--compare-migration", "--target", "engine"))


def test_passes_alternate_in_mirrored_rounds():
    assert pass_order(1) == [ON, OFF]
    assert pass_order(2) == [ON, OFF, OFF, ON]
    assert pass_order(3) == [ON, OFF, OFF, ON, ON, OFF]
    for n in (2, 4):  # each configuration's mean position is the same
        order = pass_order(n)
        assert sum(i for i, m in enumerate(order) if m == ON) == \
            sum(i for i, m in enumerate(order) if m == OFF)


def test_summary_per_configuration():
    def one(mode: str, tput: float, ttfts: list[float], moved: int) -> dict:
        return {"mode": mode, "moved": moved, "duration": 10.0, "output_throughput": tput,
                "ttft_p50_ms": 0.0, "ttft_p99_ms": 0.0,
                "results": [RequestResult(success=True, ttft=t) for t in ttfts]
                + [RequestResult(success=False, ttft=99.0)]}

    passes = [one(ON, 40.0, [1.0, 2.0], 3), one(OFF, 50.0, [3.0], 0),
              one(OFF, 56.0, [5.0], 0), one(ON, 44.0, [3.0, 4.0], 2)]
    s = summarize(passes)
    assert s[ON]["passes"] == 2 and s[ON]["streams_moved"] == 5
    assert s[ON]["output_throughput_mean"] == 42.0 and s[OFF]["output_throughput_median"] == 53.0
    assert s[ON]["ttft_p50_ms"] == 2500.0 and s[OFF]["ttft_p50_ms"] == 4000.0  # failed: left out
    text = format_summary(passes, s)
    assert "pass order: 1. migration on, 2. migration off, 3. migration off, 4. migration on" \
        in text


def test_migration_rounds_are_checked():
    assert "--migration-rounds" in check_args(_args("--migration-rounds", "0"))


# ---- --device, --gpus-per-worker, --compare-workers (kvserve.bench.serve_placement) -------------
def _placed(cuda_gpus: int, *argv: str):
    from kvserve.bench.serve_placement import resolve

    a = _args(*argv)
    assert check_args(a) is None
    return resolve(a, cuda_gpus)


def test_engines_and_workers_share_the_device_and_dtype():
    from kvserve.bench.serve_placement import Placement, engine_config, service_engine

    cuda = _placed(1)  # a CUDA host: one worker gets the GPU, the in-process engine too
    assert cuda == Placement("cuda", "bfloat16", 1.0)
    a = _args()
    check_args(a)
    eng, worker = engine_config(a, cuda), service_engine(a, cuda)
    # dtype auto stays auto (bfloat16 on CUDA), so the engine picks its KV cache's dtype
    assert (eng.device, eng.resolved_dtype(), eng.num_threads) == ("cuda", "bfloat16", None)
    assert worker.model_dump() == eng.model_dump()  # no CPU threads forced onto a GPU worker
    assert _placed(1, "--workers", "2").gpus_per_worker == 0.5  # two workers, one GPU
    assert _placed(4, "--workers", "3").gpus_per_worker == 1.0
    assert _placed(2, "--workers", "3").gpus_per_worker == 0.5
    pinned = _placed(1, "--dtype", "float32")
    assert pinned.dtype == "float32"
    assert engine_config(_args("--dtype", "float32"), pinned).dtype == "float32"
    half = _args("--kv-cache-dtype", "float16")
    assert engine_config(half, cuda).kv_cache_dtype == service_engine(half, cuda).kv_cache_dtype == "float16"
    cpu = _placed(0, "--workers", "2", "--kv-cache-tokens", "4096")
    assert cpu == Placement("cpu", "float32", 0.0)
    a = _args("--workers", "2", "--kv-cache-tokens", "4096")
    check_args(a)
    from kvserve.hardware import available_cores

    assert engine_config(a, cpu).num_threads == available_cores()
    assert service_engine(a, cpu).num_threads == max(1, available_cores() // 2)
    assert service_engine(a, cpu).kv_cache_tokens == 4096  # the KV splits only to compare


def test_compare_workers_splits_the_kv_and_keeps_the_gpu_share():
    from kvserve.bench.serve_placement import service_engine

    a = _args("--compare-workers", "--gpus-per-worker", "0.5", "--kv-cache-tokens", "65536")
    assert check_args(a) is None and a.workers == 2  # the mode's default
    p = _placed(1, "--compare-workers", "--gpus-per-worker", "0.5", "--kv-cache-tokens", "65536")
    assert p.gpus_per_worker == 0.5
    assert service_engine(a, p).kv_cache_tokens == 32768  # in both configurations
    a = _args("--compare-workers", "--workers", "4")
    check_args(a)
    assert service_engine(a, _placed(0)).kv_cache_tokens == 32768 // 4  # the default pool


def test_bad_placements_are_one_clear_line():
    def err(cuda_gpus: int, *argv: str) -> str:
        out = _placed(cuda_gpus, *argv)
        assert isinstance(out, str) and "\n" not in out
        return out

    assert "the device is cpu (--device cpu)" in err(1, "--device", "cpu", "--gpus-per-worker", "1")
    assert "no CUDA GPU" in err(0, "--gpus-per-worker", "0.5")
    assert "no CUDA GPU" in err(0, "--device", "cuda")
    assert "needs --gpus-per-worker > 0" in err(1, "--device", "cuda", "--gpus-per-worker", "0")
    assert "[0, 1]" in err(1, "--gpus-per-worker", "2")
    assert "--threads" in err(1, "--threads", "4")
    assert "--compare-workers" in check_args(_args("--compare-workers", "--workers", "1"))
    assert "self-started" in check_args(_args("--compare-workers", "--compare-engine"))
    assert "self-started" in check_args(_args("--compare-workers", "--port", "9000"))
    assert "fewer than 16" in check_args(_args("--compare-workers", "--kv-cache-tokens", "20"))
    assert "self-started" in check_args(_args("--gpus-per-worker", "1", "--target", "engine"))


def test_worker_passes_alternate_in_mirrored_rounds():
    from kvserve.bench.serve_workers import modes

    one, many = modes(2)
    assert pass_order(2, (one, many)) == [one, many, many, one]
    passes = [{"mode": m, "moved": 0, "duration": 1.0, "output_throughput": t, "results": [
        RequestResult(success=True, ttft=0.1)]} for m, t in ((one, 10.0), (many, 18.0))]
    s = summarize(passes, (one, many))
    assert s[many]["output_throughput_median"] / s[one]["output_throughput_median"] == 1.8
