"""`kvserve bench serve`: online serving benchmark in the manner of `vllm bench serve`.

Requests (random or prefix-repetition prompts) go out at Poisson/gamma arrival times,
at most --max-concurrency at once, to the gRPC or OpenAI HTTP endpoint of a running
service, or straight into an in-process AsyncLLMEngine (--target engine).
--compare-engine runs the same requests through the engine and through the target, and
prints two figures: output tok/s of target / engine, and the TTFT p50 overhead
in ms. It alternates the two over --rounds slices of the requests (the engine's turns with
the self-started service paused), so that host drift does not decide the ratio; --rounds 1
runs the whole engine run first, before Ray starts. Without --host and --port, a grpc/http
run starts the service itself (one worker, the same engine settings, device and dtype as
the in-process engine; on a CUDA host each worker gets a GPU share) and stops it at the end.
--compare-workers runs the requests through one worker and through --workers N workers of
the self-started service (kvserve.bench.serve_workers). --prefill-workers P --decode-workers D
runs them through P prefill and D decode workers and through the same P + D workers as mixed
workers (kvserve.bench.serve_disagg).
--ramp SECONDS:RATE,... sends the requests at a rate that changes by segment (low, burst,
low); --compare-autoscaling runs such a ramp against fixed pools of --min-workers and
--max-workers workers and the autoscaled pool between them (kvserve.bench.serve_autoscale).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import numpy as np

from kvserve.bench.common import add_async_arg, write_json
from kvserve.bench.serve_autoscale import compare_autoscaling, parse_ramp, ramp_offsets
from kvserve.bench.serve_clients import BenchClient, EngineClient, GrpcClient, HttpClient
from kvserve.bench.serve_dataset import (
    BenchRequest,
    arrival_offsets,
    long_short_dataset,
    prefix_repetition_dataset,
    random_dataset,
)
from kvserve.bench.serve_load import CpuMeter
from kvserve.bench.serve_metrics import (
    RequestResult,
    compare,
    compute_metrics,
    format_block,
    parse_goodput,
)
from kvserve.bench.serve_migration import apply_skew, compare_migration
from kvserve.bench.serve_placement import engine_config, resolve, service_engine
from kvserve.bench.serve_workers import SEED_STEP, compare_workers

DEFAULT_PORTS = {"grpc": 9000, "http": 8000}


class BenchError(Exception):
    """A run that cannot go on (server unreachable, warm-up rejected): one clear line."""


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("serve", help="online serving benchmark (vllm bench serve style)")
    p.add_argument("--target", choices=["grpc", "http", "engine"], default="grpc")
    p.add_argument("--host", default=None,
                   help="server host (127.0.0.1 if only --port is given); with neither, the "
                        "bench starts the service itself (one worker) for the run")
    p.add_argument("--port", type=int, default=None, help="default: 9000 grpc, 8000 http")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None,
                   help="model the in-process engine / self-started service loads, and whose "
                        "tokenizer makes the prompts (default: SmolLM2-135M)")
    p.add_argument("--served-model-name", default=None,
                   help="`model` sent to the server (default: the first it lists)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (inf = all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier")
    p.add_argument("--ramp", default=None, metavar="SECONDS:RATE,...",
                   help="a rate that changes by segment, e.g. 20:0.5,40:3,40:0.5 (low, burst, "
                        "low); the requests are those the segments' arrivals make (instead of "
                        "--num-prompts and --request-rate)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--dataset", choices=["random", "prefix-repetition", "long-short"],
                   default="random",
                   help="long-short: --random-input-len prompts with a share (--long-share) "
                        "of --long-input-len ones among them")
    p.add_argument("--random-input-len", type=int, default=128,
                   help="prompt tokens (the suffix length for prefix-repetition)")
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct prefixes")
    p.add_argument("--long-input-len", type=int, default=1024, help="long-short: long prompts' tokens")
    p.add_argument("--long-share", type=float, default=0.25,
                   help="long-short: share of the requests with a long prompt")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 e2el:5000")
    p.add_argument("--percentiles", default="99", help="comma list, e.g. 50,90,99")
    p.add_argument("--compare-engine", action="store_true",
                   help="run the same requests through an in-process engine too, and print "
                        "the target/engine throughput ratio and the TTFT overhead")
    p.add_argument("--rounds", type=int, default=4,
                   help="with --compare-engine: alternate engine and target over this many "
                        "slices of the requests, the self-started service paused during the "
                        "engine's (1 = the whole engine run first, then the target); with "
                        "--compare-workers: mirrored rounds of a 1-worker and an N-worker pass")
    p.add_argument("--num-warmups", type=int, default=2,
                   help="untimed requests (other prompts) before each timed run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, metavar="FILE", help="write all figures as JSON")
    p.add_argument("--save-detailed", action="store_true",
                   help="with --save-result: also per-request ttft/itl/e2el")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    g = p.add_argument_group("engine (in-process engine and self-started service)")
    g.add_argument("--kv-cache-tokens", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--threads", type=int, default=None,
                   help="CPU torch threads (default: all cores in-process, cores/N for each of "
                        "N service workers; not for cuda)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="the engines' device, in-process and in the service's workers "
                        "(auto: cuda if torch sees a GPU)")
    g.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="weights and KV (auto: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "float32", "float16", "bfloat16"],
                   default=None, help="the KV cache's dtype (the engine's default: auto)")
    g.add_argument("--cpu-matmul", choices=["int8", "exact"], default=None,
                   help="CPU engines on GGUF blocks: 8-bit activations (int8, the engine's "
                        "default) or float32 ones (exact)")
    g.add_argument("--gpus-per-worker", type=float, default=None,
                   help="self-started service: each worker's GPU share, in [0, 1] (0.5: two "
                        "workers on one GPU); default on cuda: 1 while there is a GPU per "
                        "worker, else an even share; 0 on cpu")
    add_async_arg(g)
    g.add_argument("--stream-interval-ms", type=float, default=None,
                   help="self-started service: least time between a stream's chunks "
                        "(0 = every engine step; default: the service's automatic pacing)")
    m = p.add_argument_group("skewed load and stream migration (self-started service)")
    m.add_argument("--workers", type=int, default=None,
                   help="workers of the self-started service (default 1; 2 with "
                        "--compare-workers)")
    m.add_argument("--compare-workers", action="store_true",
                   help="the requests through one worker and through --workers N workers, "
                        "each worker with 1/N of --kv-cache-tokens and the same GPU share, in "
                        "mirrored passes (--rounds rounds of two)")
    m.add_argument("--skew", type=float, default=0.0,
                   help="share of requests in one session, pinned to one worker (0..1)")
    m.add_argument("--compare-migration", action="store_true",
                   help="run the requests with stream migration on and off, in alternating "
                        "passes after an untimed priming pass")
    m.add_argument("--migration-rounds", type=int, default=2,
                   help="--compare-migration: rounds of two passes, mirrored (on, off, off, "
                        "on, ...)")
    s = p.add_argument_group("autoscaling (self-started service)")
    s.add_argument("--compare-autoscaling", action="store_true",
                   help="the requests (a --ramp) through fixed pools of --min-workers and "
                        "--max-workers workers and through the autoscaled pool between them: "
                        "worker-seconds, TTFT, time parked, requests lost, pressure to serving")
    s.add_argument("--min-workers", type=int, default=1)
    s.add_argument("--max-workers", type=int, default=3)
    s.add_argument("--upscale-delay-s", type=float, default=2.0,
                   help="the autoscaled pass's (default 2)")
    s.add_argument("--downscale-delay-s", type=float, default=10.0,
                   help="the autoscaled pass's (default 10)")
    d = p.add_argument_group("disaggregated serving (self-started service)")
    d.add_argument("--prefill-workers", type=int, default=0,
                   help="with --decode-workers: the requests through this many prefill and "
                        "that many decode workers, and through as many mixed workers, in "
                        "mirrored passes (the router re-roles the same workers)")
    d.add_argument("--decode-workers", type=int, default=0)
    d.add_argument("--disagg-rounds", type=int, default=2,
                   help="rounds of two passes (disaggregated, mixed, mixed, disaggregated...)")
    d.add_argument("--disagg-min-prompt-tokens", type=int, default=None,
                   help="the service's disagg_min_prompt_tokens (default: the service's)")
    d.add_argument("--handoff-sweep", default=None, metavar="N,N,...",
                   help="after the passes: prompts of these lengths, one at a time, handed "
                        "off and prefilled locally: the hand-off time and bytes by length")
    p.set_defaults(func=cmd_serve)


# ---- the run ---------------------------------------------------------------------------------
async def run_requests(
    client: BenchClient,
    requests: list[BenchRequest],
    offsets: list[float],
    max_concurrency: int | None,
    progress: bool = False,
    desc: str = "",
) -> tuple[list[RequestResult], float]:
    """Send request i at `offsets[i]` s after the start (later if --max-concurrency is full);
    return the results in request order and the wall time from start to the last answer."""
    from tqdm import tqdm

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr,
               disable=not progress, leave=False, dynamic_ncols=True)
    start = time.perf_counter()

    async def one(req: BenchRequest, at: float) -> RequestResult:
        delay = start + at - time.perf_counter()  # absolute schedule: sleeps do not drift
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            res = await client.send(req)
        else:
            async with sem:
                res = await client.send(req)
        bar.update(1)
        return res

    try:
        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets, strict=True)))
    finally:
        bar.close()
    return list(results), time.perf_counter() - start


async def _start(client: BenchClient) -> None:
    try:
        await client.start()
    except Exception as e:  # unreachable server, wrong key on ListModels, model load error
        await client.close()
        raise BenchError(f"{client.name}: cannot start: {_describe(e)}") from e


async def _warm_up(client: BenchClient, warmups: list[BenchRequest]) -> None:
    for w in warmups:  # one at a time: the first forward passes are slow, keep them out
        r = await client.send(w)
        if not r.success:
            raise BenchError(f"{client.name}: warm-up request failed: {r.error}")


async def bench_one(
    client: BenchClient,
    requests: list[BenchRequest],
    warmups: list[BenchRequest],
    a: argparse.Namespace,
) -> tuple[list[RequestResult], float, CpuMeter]:
    await _start(client)
    try:
        await _warm_up(client, warmups)
        offsets = (a.offsets if getattr(a, "offsets", None)
                   else arrival_offsets(len(requests), a.request_rate, a.burstiness, a.seed))
        with CpuMeter() as meter:
            res, dur = await run_requests(client, requests, offsets, a.max_concurrency,
                                          a.progress, f"bench {client.name}")
        return res, dur, meter
    finally:
        await client.close()


async def bench_interleaved(
    engine: BenchClient,
    target: BenchClient,
    requests: list[BenchRequest],
    warmups: list[BenchRequest],
    a: argparse.Namespace,
    pause: Callable[[], contextlib.AbstractContextManager],
) -> tuple[tuple[list[RequestResult], float, CpuMeter], ...]:
    """--compare-engine --rounds N: the requests in N slices, each run through the engine and
    then the target (the other order every second round), so that a host whose speed drifts
    (shared or throttled machines swing by 15% within a minute) weighs on both alike. The
    engine's turns run inside `pause()`: with the self-started service stopped meanwhile, the
    engine has the machine without Ray, as when used directly."""
    clients = (engine, target)

    def turn(i: int) -> contextlib.AbstractContextManager:
        return pause() if i == 0 else contextlib.nullcontext()

    started: list[BenchClient] = []
    try:
        for c in clients:
            await _start(c)
            started.append(c)
        for i, c in enumerate(clients):
            with turn(i):
                await _warm_up(c, warmups)
        results: tuple[list[RequestResult], ...] = ([], [])
        wall, cpu = [0.0, 0.0], ([], [])
        rounds = min(a.rounds, len(requests))
        bounds = np.linspace(0, len(requests), rounds + 1).round().astype(int)
        for k in range(rounds):
            part = requests[bounds[k]:bounds[k + 1]]
            offsets = arrival_offsets(len(part), a.request_rate, a.burstiness, a.seed + k)
            for i in ((0, 1) if k % 2 == 0 else (1, 0)):
                with turn(i), CpuMeter() as meter:
                    res, dur = await run_requests(clients[i], part, offsets, a.max_concurrency,
                                                  a.progress, f"{clients[i].name} {k + 1}/{rounds}")
                results[i].extend(res)
                wall[i] += dur
                cpu[i].append(meter)
        return tuple((results[i], wall[i], CpuMeter.merged(cpu[i])) for i in (0, 1))
    finally:
        for c in started:
            await c.close()


def _describe(e: BaseException) -> str:
    details = getattr(e, "details", None)  # grpc.aio.AioRpcError
    if callable(details) and callable(getattr(e, "code", None)):
        return f"{e.code().name}: {details()}"
    return f"{type(e).__name__}: {e}"


def _client(a: argparse.Namespace, host: str, port: int) -> BenchClient:
    cls = GrpcClient if a.target == "grpc" else HttpClient
    # None: the client asks the server for its model list and uses the first name
    return cls(host, port, model=a.served_model_name, api_key=a.api_key)


def build_requests(
    a: argparse.Namespace, tok: Any, seed: int, num: int, output_len: int
) -> list[BenchRequest]:
    if num == 0:
        return []
    if a.dataset == "random":
        return random_dataset(tok, num, a.random_input_len, output_len,
                              a.random_range_ratio, seed)
    if a.dataset == "long-short":
        return long_short_dataset(tok, num, a.random_input_len, a.long_input_len, a.long_share,
                                  output_len, a.random_range_ratio, seed)
    return prefix_repetition_dataset(tok, num, a.prefix_len, a.num_prefixes, a.random_input_len,
                                     output_len, a.random_range_ratio, seed)


def check_args(a: argparse.Namespace) -> str | None:
    """The first problem with the arguments, as a message; None if they are fine."""
    for name in ("num_prompts", "random_input_len", "random_output_len", "max_concurrency",
                 "kv_cache_tokens", "max_num_seqs", "threads", "port"):
        v = getattr(a, name)
        if v is not None and v < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {v}"
    if a.num_warmups < 0:
        return f"--num-warmups must be >= 0, got {a.num_warmups}"
    if a.rounds < 1:
        return f"--rounds must be >= 1, got {a.rounds}"
    if a.migration_rounds < 1:
        return f"--migration-rounds must be at least 1, got {a.migration_rounds}"
    if not 0 <= a.skew <= 1:
        return f"--skew must be in [0, 1], got {a.skew}"
    if a.prefill_workers or a.decode_workers:
        if not (a.prefill_workers > 0 and a.decode_workers > 0):
            return "--prefill-workers and --decode-workers go together, each >= 1"
        if (a.target == "engine" or a.compare_engine or a.compare_migration or a.compare_workers
                or a.host or a.port or a.workers):
            return ("--prefill-workers/--decode-workers run a self-started grpc or http "
                    "service on their own (P + D workers, compared with as many mixed ones)")
        if a.disagg_rounds < 1:
            return f"--disagg-rounds must be at least 1, got {a.disagg_rounds}"
        a.workers = a.prefill_workers + a.decode_workers
    elif a.handoff_sweep or a.disagg_min_prompt_tokens is not None:
        return "--handoff-sweep and --disagg-min-prompt-tokens need --prefill-workers/--decode-workers"
    try:
        a.handoff_sweep = [int(x) for x in (a.handoff_sweep or "").split(",") if x.strip()]
    except ValueError:
        return f"--handoff-sweep takes prompt lengths, e.g. 64,256,1024, got {a.handoff_sweep!r}"
    if any(n < 1 for n in a.handoff_sweep):
        return "--handoff-sweep lengths must be >= 1"
    if a.workers is None:
        a.workers = 2 if a.compare_workers else 1
    if a.workers < 1:
        return f"--workers must be >= 1, got {a.workers}"
    if a.compare_migration and (a.target == "engine" or a.compare_engine or a.host or a.port):
        return "--compare-migration runs a self-started grpc or http service on its own"
    if a.compare_workers and (a.target == "engine" or a.compare_engine or a.compare_migration
                              or a.host or a.port):
        return "--compare-workers runs a self-started grpc or http service on its own"
    if a.compare_workers and a.workers < 2:
        return f"--compare-workers compares 1 worker with --workers N >= 2, got {a.workers}"
    if a.compare_workers and a.kv_cache_tokens is not None and a.kv_cache_tokens // a.workers < 16:
        return (f"--kv-cache-tokens {a.kv_cache_tokens} over {a.workers} workers leaves fewer "
                "than 16 tokens each")
    if a.compare_autoscaling:
        if a.target == "engine" or a.compare_engine or a.compare_migration or \
                a.compare_workers or a.host or a.port:
            return "--compare-autoscaling runs a self-started grpc or http service on its own"
        if a.prefill_workers:
            return ("autoscaling works on mixed workers only; --compare-autoscaling cannot be "
                    "combined with --prefill-workers/--decode-workers")
        if not a.ramp:
            return "--compare-autoscaling needs a --ramp (e.g. 20:0.5,40:3,40:0.5)"
        if not 1 <= a.min_workers < a.max_workers:
            return (f"--compare-autoscaling compares --min-workers >= 1 with a larger "
                    f"--max-workers, got {a.min_workers} and {a.max_workers}")
        a.workers = a.max_workers  # each worker's threads and GPU share: as the largest pool
    if a.ramp:
        try:
            a.offsets = ramp_offsets(parse_ramp(a.ramp), a.burstiness, a.seed)
        except ValueError as e:
            return str(e)
        if not a.offsets:
            return f"--ramp {a.ramp} makes no request with --seed {a.seed}"
        a.num_prompts = len(a.offsets)
    if a.gpus_per_worker is not None and (a.target == "engine" or a.host or a.port):
        return "--gpus-per-worker is for the self-started service (no --host/--port)"
    if a.target == "engine" and a.compare_engine:
        return "--compare-engine compares a grpc or http target with the engine"
    if a.target == "engine" and (a.host or a.port):
        return "--target engine runs in this process; --host/--port are for grpc/http"
    try:
        parse_goodput(a.goodput)
        arrival_offsets(1, a.request_rate, a.burstiness, 0)
        a.percentile_list = [float(x) for x in a.percentiles.split(",") if x.strip()]
    except ValueError as e:
        return str(e)
    if not a.percentile_list or not all(0 < p <= 100 for p in a.percentile_list):
        return f"--percentiles must be numbers in (0, 100], got {a.percentiles!r}"
    return None


def cmd_serve(a: argparse.Namespace) -> int:
    err = check_args(a)
    if err is None:
        import torch

        placed = resolve(a, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        err, a.placement = (placed, None) if isinstance(placed, str) else (None, placed)
    if err:
        print(f"kvserve bench serve: {err}", file=sys.stderr)
        return 2
    try:
        return _bench(a)
    except BenchError as e:
        print(f"kvserve bench serve: {e}", file=sys.stderr)
        return 1


def _bench(a: argparse.Namespace) -> int:
    slos = parse_goodput(a.goodput)
    from kvserve.models import resolve_model
    from kvserve.workers.loading.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(a.model, tokenizer_only=True))
    requests = apply_skew(build_requests(a, tok, a.seed, a.num_prompts, a.random_output_len),
                          a.skew, a.seed)
    warmups = build_requests(a, tok, a.seed + 7919, a.num_warmups, 4)
    runs: dict[str, dict[str, Any]] = {}

    def record(name: str, results: list[RequestResult], duration: float, meter: CpuMeter,
               whole_stack: bool = True) -> dict[str, Any]:
        """`whole_stack`: the meter saw the serving side too (in-process or self-started);
        for a server elsewhere its CPU is "other load", and the CPU figures mean nothing."""
        m = compute_metrics(results, duration, slos, a.percentile_list)
        if not whole_stack:
            meter.figures = {}
        if meter.figures and m["total_output_tokens"]:
            # CPU of the whole serving stack (client included) per token: steadier than tok/s
            # under other load, and on a CPU-bound host the serving path's cost shows here
            m["cpu_ms_per_output_token"] = (meter.figures["bench_cores"] * duration * 1000.0
                                            / m["total_output_tokens"])
        errors = sorted({r.error for r in results if not r.success})
        runs[name] = {"metrics": m, "errors": errors[:10], "cpu": meter.figures}
        if a.save_detailed:
            runs[name]["requests"] = [
                {"prompt_len": r.prompt_len, "output_len": r.output_len, "ttft": r.ttft,
                 "itl": r.itl, "latency": r.latency, "error": r.error} for r in results
            ]
        title = f"Serving Benchmark Result ({name})"
        print(format_block(m, title, a.percentile_list, a.max_concurrency))
        for e in errors[:3]:
            print(f"  failed: {e}")
        if warn := meter.warning(name):
            print(warn)
        return m

    if a.compare_engine and (a.host or a.port):
        print("bench serve: note: the in-process engine runs with this command's engine "
              "settings; the server at --host must use the same for a fair comparison",
              file=sys.stderr)
    service = None
    host, port = a.host or "127.0.0.1", a.port or DEFAULT_PORTS[a.target]

    def start() -> None:
        nonlocal service, host, port
        if a.target != "engine" and a.host is None and a.port is None:
            from kvserve.bench.serve_service import start_service

            workers = 1 if a.compare_workers else a.workers  # resized pass by pass
            roles: dict[str, Any] = {}
            if a.prefill_workers:  # re-roled pass by pass
                workers = 0
                roles = {"prefill_workers": a.prefill_workers,
                         "decode_workers": a.decode_workers}
                if a.disagg_min_prompt_tokens is not None:
                    roles["disagg_min_prompt_tokens"] = a.disagg_min_prompt_tokens
            service = start_service(service_engine(a, a.placement), a.api_key,
                                    a.stream_interval_ms, workers, pin_sessions=a.skew > 0,
                                    num_gpus_per_worker=a.placement.gpus_per_worker, **roles)
            host, port = "127.0.0.1", service.port(a.target)

    moved: dict[str, Any] | None = None
    scaled: dict[str, Any] | None = None
    autoscaled: dict[str, Any] | None = None
    split: dict[str, Any] | None = None
    try:
        if a.compare_autoscaling:
            from kvserve.bench.serve_service import start_service
            from kvserve.hardware import available_cores

            service = start_service(
                service_engine(a, a.placement), a.api_key, a.stream_interval_ms,
                a.min_workers, num_gpus_per_worker=a.placement.gpus_per_worker,
                # the largest pool fits a local Ray of the host's cores
                num_cpus_per_worker=min(1.0, available_cores() / a.max_workers),
                load_poll_interval_s=0.5,
                autoscaling={"min_workers": a.min_workers, "max_workers": a.max_workers,
                             "upscale_delay_s": a.upscale_delay_s,
                             "downscale_delay_s": a.downscale_delay_s})
            host, port = "127.0.0.1", service.port(a.target)

            async def run_pass(client: BenchClient, reqs: list[BenchRequest],
                               offsets: list[float], warm: list[BenchRequest]) -> tuple:
                return await bench_one(client, reqs, warm, a)

            autoscaled = compare_autoscaling(a, service, lambda: _client(a, host, port),
                                             requests, a.offsets, warmups, run_pass, record)
        elif a.prefill_workers:
            from kvserve.bench.serve_disagg import SWEEP_REPEATS, compare_disagg

            start()

            def fresh(i: int) -> list[BenchRequest]:
                return build_requests(a, tok, a.seed + (i + 1) * SEED_STEP, a.num_prompts,
                                      a.random_output_len)

            def sweep(n: int, k: int) -> list[BenchRequest]:
                return random_dataset(tok, SWEEP_REPEATS, n, 8, 0.0, a.seed + 7 * n + 100_003 * k)

            split = compare_disagg(a, service, lambda: _client(a, host, port), fresh, warmups,
                                   bench_one, record, sweep if a.handoff_sweep else None)
        elif a.compare_workers:
            start()

            def requests_for(i: int) -> list[BenchRequest]:
                return build_requests(a, tok, a.seed + (i + 1) * SEED_STEP, a.num_prompts,
                                      a.random_output_len)

            scaled = compare_workers(a, service, lambda: _client(a, host, port), requests_for,
                                     warmups, bench_one, record)
        elif a.compare_migration:
            start()
            moved = compare_migration(a, lambda: _client(a, host, port), requests, warmups,
                                      bench_one, record)
        elif a.compare_engine and a.rounds > 1:
            start()
            pause = service.paused if service is not None else contextlib.nullcontext
            outcomes = asyncio.run(bench_interleaved(
                EngineClient(engine_config(a, a.placement)), _client(a, host, port), requests,
                warmups, a, pause))
            record("engine", *outcomes[0])
            record(a.target, *outcomes[1], whole_stack=service is not None)
        else:
            if a.target == "engine" or a.compare_engine:  # first, on a machine without Ray
                record("engine", *asyncio.run(
                    bench_one(EngineClient(engine_config(a, a.placement)), requests, warmups, a)))
            if a.target != "engine":
                start()
                outcome = asyncio.run(bench_one(_client(a, host, port), requests, warmups, a))
                record(a.target, *outcome, whole_stack=service is not None)
    finally:
        if service is not None:
            service.stop()
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": a.target,
        "workload": workload(a, requests),
        # the in-process engine's settings; the self-started service's workers differ only
        # in threads on CPU (cores/N) and KV (1/N with --compare-workers)
        "engine": engine_config(a, a.placement).model_dump(),
        "service_worker_engine": service_engine(a, a.placement).model_dump(),
        "gpus_per_worker": a.placement.gpus_per_worker,
        "stream_interval_ms": a.stream_interval_ms,  # None: the service's automatic pacing
        "rounds": (min(a.rounds, a.num_prompts) if a.compare_engine
                   else a.rounds if a.compare_workers else 1),
        "runs": runs,
    }
    if moved is not None:
        report["workers"], report["skew"], report["migration"] = a.workers, a.skew, moved
    if scaled is not None:
        report["workers"], report["compare_workers"] = a.workers, scaled
    if autoscaled is not None:
        report["compare_autoscaling"] = autoscaled
    if split is not None:
        report["prefill_workers"], report["decode_workers"] = a.prefill_workers, a.decode_workers
        report["disagg"] = split
    if a.compare_engine:
        c = compare(runs["engine"]["metrics"], runs[a.target]["metrics"])
        report["comparison"] = c
        print(f"{a.target} / engine output tok/s: {c['output_throughput_ratio']:.3f}x   "
              f"TTFT p50 overhead: {c['ttft_p50_overhead_ms']:+.1f} ms   "
              f"(mean {c['ttft_mean_overhead_ms']:+.1f} ms)")
        if "cpu_per_token_ratio" in c:
            print(f"{a.target} / engine CPU per output token: {c['cpu_per_token_ratio']:.3f}x")
    write_json(a.save_result, report)
    failed = sum(r["metrics"]["failed"] for r in runs.values())
    return 1 if failed else 0


def workload(a: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    from kvserve.bench.common import available_cores

    w = {
        "dataset": a.dataset, "num_prompts": a.num_prompts, "request_rate": a.request_rate,
        "burstiness": a.burstiness, "max_concurrency": a.max_concurrency,
        "random_input_len": a.random_input_len, "random_output_len": a.random_output_len,
        "random_range_ratio": a.random_range_ratio, "seed": a.seed,
        "model": a.model or "default", "num_warmups": a.num_warmups,
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "host": a.host or ("127.0.0.1" if a.port else "self-started"), "cores": available_cores(),
    }
    if a.dataset == "prefix-repetition":
        w.update(prefix_len=a.prefix_len, num_prefixes=a.num_prefixes)
    if a.dataset == "long-short":
        w.update(long_input_len=a.long_input_len, long_share=a.long_share)
    if math.isinf(a.request_rate):
        w["request_rate"] = "inf"  # JSON has no Infinity
    if a.ramp:
        w["ramp"] = a.ramp
    return w
