"""Metrics on Ray's Prometheus endpoint: every kvserve metric, with the values requests imply.

Runs on the session's serve app (its Ray exports on `serve_app.metrics_port`), so the checks
compare a settled scrape before this module's requests with one after them, series by
series. The requests: a burst that overflows the workers' device KV (evictions to the host
tier and restores), a session, a repeated prompt, bad and unauthenticated requests on both
front ends, a request shed for overload, two streams and one more cancelled by the client,
and a request that fails on its worker (its request id is in use there). A cancel that Serve's
gRPC proxy drops (ServeApp.cancels_serve_dropped) is counted as the `length` it becomes.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import ray

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "kvserve" / "dashboards" / "kvserve.json"
DASHBOARD_PARSER = ROOT / "tests" / "helm" / "dashboard_metrics.py"

P = "ray_kvserve_"  # Ray prefixes custom metrics with "ray_"; counters end in "_total"
WORKER_COUNTERS = ["requests_received", "requests_finished", "prompt_tokens", "generation_tokens",
                   "prefix_cache_hit_tokens", "kv_evictions", "kv_restored_blocks",
                   "kv_restored_bytes", "kv_recomputed_tokens", "kv_host_copy_seconds",
                   "kv_restores", "kv_writebacks_skipped", "spec_decode_drafts",
                   "spec_decode_draft_tokens", "spec_decode_accepted_tokens"]
WORKER_GAUGES = ["requests_running", "requests_waiting", "kv_device_blocks_used",
                 "kv_device_blocks_capacity", "kv_host_blocks_used", "kv_host_blocks_capacity",
                 "streams_running", "streams_parked", "kv_host_copy_gbps", "prefill_tokens_per_s"]
WORKER_HISTOGRAMS = ["time_to_first_token_seconds", "time_per_output_token_seconds",
                     "e2e_request_latency_seconds", "queue_wait_seconds"]
MIGRATION_COUNTERS = ["migration_streams", "migration_bytes", "migration_failures",
                      "migration_sessions"]  # the router's, per worker
MOVE_HISTOGRAMS = ["stream_move_stall_seconds", "stream_move_rounds"]  # the router's
AUTOSCALER_GAUGES = ["autoscaler_desired_workers", "autoscaler_workers",
                     "autoscaler_queued_requests", "autoscaler_cold_start_seconds",
                     "autoscaler_pressure_to_serving_seconds"]  # the router's, on or off
DISAGG_COUNTERS = ["disagg_handoffs", "disagg_local_prefills"]  # the router's
DISAGG_HISTOGRAMS = ["disagg_handoff_seconds", "disagg_handoff_bytes"]
EXPORTED = sorted(
    [f"{P}{n}_total" for n in [*WORKER_COUNTERS, "requests_rejected", "router_decisions",
                               "router_retries", "stream_moves", "autoscaler_decisions",
                               *MIGRATION_COUNTERS, *DISAGG_COUNTERS]]
    + [f"{P}{n}" for n in [*WORKER_GAUGES, "router_workers_alive", "worker_draining",
                           *AUTOSCALER_GAUGES]]
    + [f"{P}{n}_{s}" for n in [*WORKER_HISTOGRAMS, *DISAGG_HISTOGRAMS]
       for s in ("bucket", "sum", "count")]
)
# a prompt longer than the default disagg_min_prompt_tokens: handed off while the app's
# workers are re-roled as a prefill and a decode worker
HANDOFF_PROMPT = 300

# The burst: 5 requests per worker whose prompts (42 blocks of 16) fit the 256-block device
# pool together but whose answers (55 blocks each) do not: the engines evict and restore.
BURST, BURST_PROMPT, BURST_TOKENS = 10, 672, 200
# The streams the client cancels: long enough that one whose cancel Serve drops (see
# ServeApp.cancels_serve_dropped) is still running when the test looks.
CANCELLED_TOKENS = 900

Series = dict[tuple[str, frozenset], float]
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> Series:
    """Prometheus text -> {(name, labels): value}."""
    out: Series = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or line.startswith("#"):
            continue
        labels = frozenset(_LABEL.findall(m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def scrape(port: int) -> Series:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return parse(r.read().decode())


def kvserve_only(s: Series) -> Series:
    """The metrics of this issue (not the raw engine stats `ray_kvserve_worker_*`, whose
    rates keep changing while idle)."""
    return {k: v for k, v in s.items() if k[0].startswith(P)
            and (not k[0].startswith(P + "worker_") or k[0] == P + "worker_draining")}


def settled(port: int, until: Callable[[Series], bool] = lambda s: True,
            timeout: float = 120.0) -> Series:
    """A scrape whose kvserve values stopped changing (Ray reports every second) and that
    meets `until`; the last scrape when time runs out (the assertions then say what is off)."""
    deadline = time.monotonic() + timeout
    prev = kvserve_only(scrape(port))
    while True:
        time.sleep(2.5)
        cur = kvserve_only(scrape(port))
        if (cur == prev and until(cur)) or time.monotonic() > deadline:
            return cur
        prev = cur


@dataclass
class Run:
    before: Series
    after: Series
    names: set[str]  # every metric name of the final scrape (Ray's own included)
    model: str
    scraped: Series = field(default_factory=dict)  # that final scrape, every series
    usages: list[tuple[int, int, int]] = field(default_factory=list)  # finished requests
    aborted: list[tuple[int, int, int]] = field(default_factory=list)  # as last seen
    aborted_max_tokens: int = 0
    dropped_cancels: int = 0  # cancelled streams that ran to their end (Serve lost the cancel)
    expect: dict[str, int] = field(default_factory=dict)  # what each count must grow by

    def total(self, name: str, **labels: str) -> float:
        """Growth of the sum of the series named `name` carrying `labels` (per series, so a
        series that appeared counts from 0)."""
        want = set(labels.items())
        grew = 0.0
        for (n, lab), v in self.after.items():
            if n == name and want <= lab:
                grew += v - self.before.get((n, lab), 0.0)
        return grew

    def now(self, name: str, **labels: str) -> list[float]:
        want = set(labels.items())
        return [v for (n, lab), v in self.after.items() if n == name and want <= lab]


def _md(app) -> tuple:
    return app.metadata


def _http(app, path: str, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(app.http_url + path, data=json.dumps(body).encode(),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _sampling(n: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _drive(app, stub, run: Run) -> dict[str, int]:
    """Send this module's requests; returns what each outcome's count must grow by."""
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 40000) for _ in range(BURST_PROMPT)] for _ in range(BURST)]

    def burst(i: int) -> tuple[int, int, int]:
        if i % 2:  # half over HTTP (token-id prompt), half over gRPC
            code, body = _http(app, "/v1/completions", {
                "prompt": prompts[i], "max_tokens": BURST_TOKENS, "temperature": 0,
                "ignore_eos": True}, app.api_key)
            assert code == 200, body
            u = body["usage"]
            return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], \
                u["completion_tokens"]
        r = stub.Generate(pb.GenerateRequest(prompt_token_ids=prompts[i],
                                             sampling=_sampling(BURST_TOKENS)),
                          metadata=_md(app), timeout=600)
        return r.usage.prompt_tokens, r.usage.cached_tokens, r.usage.completion_tokens

    with ThreadPoolExecutor(BURST) as ex:
        run.usages += list(ex.map(burst, range(BURST)))

    def unary(req: pb.GenerateRequest) -> None:
        r = stub.Generate(req, metadata=_md(app), timeout=300)
        run.usages.append((r.usage.prompt_tokens, r.usage.cached_tokens, r.usage.completion_tokens))

    # a repeated prompt (prefix affinity) and a two-turn session (session affinity)
    unary(pb.GenerateRequest(prompt_token_ids=prompts[0], sampling=_sampling(4)))
    for turn in ("Hello there.", "Hello there. And again?"):
        unary(pb.GenerateRequest(prompt=turn, sampling=_sampling(4), session_id="metrics-s"))

    # rejected at the ingress: invalid (both front ends), no API key (both), overload
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(prompt=""), metadata=_md(app), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _http(app, "/v1/completions", {"prompt": "hi", "temperature": -1}, app.api_key)[0] == 400
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _http(app, "/v1/completions", {"prompt": "hi"}, None)[0] == 401

    long = pb.GenerateRequest(prompt="Count from one to one thousand:",
                              sampling=_sampling(CANCELLED_TOKENS))
    run.aborted_max_tokens = 3 * CANCELLED_TOKENS

    def cancel(calls: list) -> None:
        for c in calls:
            run.aborted.append(c.first_usage)
            c.cancel()

    old = ray.get(app.router.set_max_inflight_per_worker.remote(1))
    try:
        calls = [_Stream(stub, long, _md(app)) for _ in range(2)]  # one on each worker
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=_md(app), timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        cancel(calls)
    finally:
        ray.get(app.router.set_max_inflight_per_worker.remote(old))

    # a request id already running on the worker: the worker answers with an error
    dup = pb.GenerateRequest(prompt="Count from one to one thousand:",
                             sampling=_sampling(CANCELLED_TOKENS),
                             request_id="metrics-dup", session_id="metrics-dup")
    first = _Stream(stub, dup, _md(app))
    clash = pb.GenerateRequest(prompt="hi", sampling=_sampling(4), request_id="metrics-dup",
                               session_id="metrics-dup")
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(clash, metadata=_md(app), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "in use" in e.value.details()
    cancel([first])
    # a running stream an operator moves live to the other worker (engines held meanwhile)
    with app.held() as workers:
        moved = stub.GenerateStream(pb.GenerateRequest(
            prompt="Name ten rivers:", sampling=_sampling(24), request_id="metrics-move"),
            metadata=_md(app), timeout=300)
        idx, _ = app.worker_of(workers, "metrics-move")
        ray.get(workers[idx].step_engine.remote())
        next(moved)
        res = stub.MoveStream(pb.MoveStreamRequest(request_id="metrics-move"), metadata=_md(app))
        assert res.method == "live" and res.to_worker == f"worker-{1 - idx}"
    run.usages.append(next((c.usage.prompt_tokens, c.usage.cached_tokens,
                             c.usage.completion_tokens) for c in moved if c.finish_reason))
    # a cancel Serve dropped: that request ends as `length` on its worker
    lost = run.dropped_cancels = app.cancels_serve_dropped()
    # a long prompt prefilled on worker-0 and decoded on worker-1 (disaggregated serving)
    old = ray.get(app.router.set_roles.remote(["prefill", "decode"]))
    try:
        r = stub.Generate(pb.GenerateRequest(
            prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(HANDOFF_PROMPT)],
            sampling=_sampling(8)), metadata=_md(app), timeout=300)
    finally:
        ray.get(app.router.set_roles.remote(old))
    assert (r.prefill_worker_id, r.worker_id) == ("worker-0", "worker-1")
    run.usages.append((r.usage.prompt_tokens, r.usage.cached_tokens, r.usage.completion_tokens))

    # burst, repeat + session, cancelled streams, clash, the moved stream, the handed-off one
    received = BURST + 3 + 3 + 1 + 1 + 1
    return {"length": BURST + 3 + 1 + 1 + lost, "abort": 3 - lost, "error": 1,
            "received": received,
            "picks": received - 1,  # each request that reached a worker was routed once (the
            # handed-off one as "disaggregated", not by the policy)
            "invalid": 3, "auth": 2, "overload": 1}


class _Stream:
    """A server-streaming call, read up to its first chunk."""

    def __init__(self, stub, req: pb.GenerateRequest, md: tuple) -> None:
        self.call = stub.GenerateStream(req, metadata=md, timeout=300)
        c = next(self.call)
        self.first_usage = (c.usage.prompt_tokens, c.usage.cached_tokens, len(c.delta_token_ids))

    def cancel(self) -> None:
        self.call.cancel()


@pytest.fixture(scope="module")
def run(serve_app) -> Run:
    port = serve_app.metrics_port
    app = serve_app
    app.wait_all_alive()
    before = settled(port, until=lambda s: all(
        v == 0 for (n, _), v in s.items() if n in (f"{P}requests_running", f"{P}streams_running")))
    r = Run(before, {}, set(), app.config.model_name())
    with grpc.insecure_channel(app.grpc_target) as ch:
        r.expect = _drive(app, kvserve_pb2_grpc.KVServeStub(ch), r)

    def done(s: Series) -> bool:
        r.after = s
        # and both workers seen alive again: on a loaded host a poll past the router's 5 s
        # timeout counts a worker lost until the next poll answers
        return (r.total(f"{P}requests_finished_total") == r.expect["received"]
                and not any(r.now(f"{P}requests_running"))
                and not any(r.now(f"{P}kv_device_blocks_used"))
                and r.now(f"{P}router_workers_alive", policy="affinity") == [2.0])

    r.after = settled(port, until=done, timeout=300)  # a dropped cancel runs to its end
    r.scraped = scrape(port)
    r.names = {n for n, _ in r.scraped}
    return r


def test_every_metric_is_exported_with_its_tags(run):
    names = {n for n, _ in run.after}
    assert not set(EXPORTED) - names, f"missing: {sorted(set(EXPORTED) - names)}"
    for (n, labels), _ in run.after.items():
        keys = {k for k, _ in labels}
        if n.startswith(P + "router_"):
            assert "policy" in keys, n
        elif n.startswith((P + "stream_move", P + "autoscaler_", P + "disagg_")):
            assert "policy" in keys, n
        elif n.startswith((P + "migration_", P + "worker_draining")):
            assert {"policy", "worker"} <= keys, n
        elif n.startswith(P + "requests_rejected"):
            assert ("model", run.model) in labels, n
        else:
            assert ("model", run.model) in labels and "worker" in keys, (n, labels)
    workers = {dict(lab)["worker"] for n, lab in run.after if n == f"{P}requests_received_total"}
    assert workers == {"worker-0", "worker-1"}


def test_request_counts_match_what_was_sent(run):
    e = run.expect
    assert run.dropped_cancels < 3  # at least one cancel reached its worker
    assert run.total(f"{P}requests_received_total") == e["received"]
    for reason in ("stop", "length", "abort", "error"):
        assert run.total(f"{P}requests_finished_total", reason=reason) == e.get(reason, 0), reason
    for reason in ("invalid", "auth", "overload"):
        assert run.total(f"{P}requests_rejected_total", reason=reason) == e[reason], reason


def test_latency_histograms_count_the_requests(run):
    e = run.expect
    finished = e["received"]
    with_tokens = e["length"] + e["abort"]  # the cancelled streams had their first token
    assert run.total(f"{P}e2e_request_latency_seconds_count") == finished
    assert run.total(f"{P}time_to_first_token_seconds_count") == with_tokens
    assert run.total(f"{P}queue_wait_seconds_count") == with_tokens
    # a stream the router moved mid-burst (a parked one) records the finishing worker's
    # share, or none when that worker made no token of it
    moved = run.total(f"{P}migration_streams_total", direction="in")
    assert e["length"] - moved <= run.total(f"{P}time_per_output_token_seconds_count") \
        <= e["length"]
    for h in WORKER_HISTOGRAMS:
        assert run.total(f"{P}{h}_sum") > 0, h
        inf = run.total(f"{P}{h}_bucket", le="+Inf")
        assert inf == run.total(f"{P}{h}_count"), h


def test_token_counters_match_the_usage(run):
    done, cut = run.usages, run.aborted
    assert run.total(f"{P}prompt_tokens_total") == sum(u[0] for u in done + cut)
    assert run.total(f"{P}prefix_cache_hit_tokens_total") == sum(u[1] for u in done + cut)
    generated = run.total(f"{P}generation_tokens_total")
    least = sum(u[2] for u in done + cut)  # the cancelled streams ran a little further
    assert least <= generated <= sum(u[2] for u in done) + run.aborted_max_tokens
    assert sum(u[0] for u in run.usages) >= BURST * BURST_PROMPT


def test_kv_counters_show_evictions_and_restores(run):
    assert run.total(f"{P}kv_evictions_total") > 0
    blocks = run.total(f"{P}kv_restored_blocks_total")
    assert blocks > 0
    per_block = run.total(f"{P}kv_restored_bytes_total") / blocks
    assert per_block > 0 and per_block == int(per_block)
    # the counter follows the engine's own count, worker by worker (the run that must
    # recompute is tests/workers/test_restore_policy.py: these engines copy by policy)
    gauges = {dict(lab)["worker"]: v for (n, lab), v in run.scraped.items()
              if n == "ray_kvserve_worker_tokens_recomputed"}
    counters = {dict(lab)["worker"]: v for (n, lab), v in run.after.items()
                if n == f"{P}kv_recomputed_tokens_total"}
    assert set(counters) == {"worker-0", "worker-1"} and counters == gauges, (counters, gauges)
    assert run.total(f"{P}kv_host_copy_seconds_total", direction="d2h") > 0
    assert run.total(f"{P}kv_host_copy_seconds_total", direction="h2d") > 0
    # the app's engines copy by policy (serve_fixtures.ENGINE)
    restores = run.total(f"{P}kv_restores_total")
    assert restores > 0 and run.total(f"{P}kv_restores_total", decision="copy", reason="policy") > 0
    assert run.total(f"{P}kv_restores_total", reason="not_on_host") <= restores
    # every (decision, reason) series exists from the start
    assert len({lab for n, lab in run.after if n == f"{P}kv_restores_total"}) >= 2 * 6


def test_moves_are_counted_by_reason_method_and_outcome(run):
    live = run.total(f"{P}stream_moves_total", reason="operator", method="live",
                     outcome="moved")
    assert live >= 1  # the operator's move (the planner may have moved more)
    assert run.total(f"{P}stream_move_stall_seconds_count", method="live") >= live
    assert run.total(f"{P}stream_move_rounds_count") >= live
    assert run.total(f"{P}stream_move_stall_seconds_sum", method="live") > 0
    # every (reason, method, outcome) series exists from the start
    assert len({lab for n, lab in run.after if n == f"{P}stream_moves_total"}) == 4 * 2 * 3


def test_cost_model_figures_are_exported(run):
    for d in ("d2h", "h2d"):
        values = run.now(f"{P}kv_host_copy_gbps", direction=d)
        assert len(values) == 2 and all(v > 0 for v in values), (d, values)
    rates = run.now(f"{P}prefill_tokens_per_s")
    assert len(rates) == 2 and all(v > 0 for v in rates), rates


def test_kv_and_queue_gauges_are_back_to_zero(run):
    for g in ("requests_running", "requests_waiting", "kv_device_blocks_used",
              "kv_host_blocks_used", "streams_running", "streams_parked"):
        values = run.now(f"{P}{g}")
        assert len(values) >= 2 and not any(values), (g, values)
    totals = run.now(f"{P}kv_device_blocks_capacity")
    assert len(totals) >= 2 and set(totals) == {256.0}, totals  # 4096 tokens / 16
    assert all(v > 0 for v in run.now(f"{P}kv_host_blocks_capacity"))


def test_router_metrics(run):
    kinds = ("device_affinity", "host_affinity", "session", "least_loaded")
    by_kind = {k: run.total(f"{P}router_decisions_total", kind=k, policy="affinity")
               for k in kinds}
    assert sum(by_kind.values()) == run.expect["picks"], by_kind
    assert by_kind["least_loaded"] >= BURST and by_kind["session"] >= 2, by_kind
    assert by_kind["device_affinity"] + by_kind["host_affinity"] >= 1, by_kind
    assert run.total(f"{P}router_retries_total", policy="affinity") == 0
    assert run.now(f"{P}router_workers_alive", policy="affinity") == [2.0]


def test_autoscaler_metrics(run):
    # the session's app is a fixed pool of two: its size, and no decision of the policy
    assert run.now(f"{P}autoscaler_desired_workers", policy="affinity") == [2.0]
    assert run.now(f"{P}autoscaler_workers", state="serving") == [2.0]
    assert run.now(f"{P}autoscaler_workers", state="starting") == [0.0]
    assert run.now(f"{P}autoscaler_workers", state="draining") == [0.0]
    assert run.now(f"{P}autoscaler_queued_requests") == [0.0]
    assert run.now(f"{P}autoscaler_cold_start_seconds") == [0.0]  # no start by the policy
    decisions = {dict(lab)["reason"] for n, lab in run.after if n == f"{P}autoscaler_decisions_total"}
    assert decisions >= {"kv_pressure", "queue", "ttft", "no_worker", "low_load", "idle"}
    assert run.total(f"{P}autoscaler_decisions_total") == 0


def test_migration_metrics(run):
    # exported for each worker from the router's start; planned moves may happen in the burst
    for d in ("in", "out"):
        assert len(run.now(f"{P}migration_streams_total", direction=d, policy="affinity")) == 2
    streams = {d: run.total(f"{P}migration_streams_total", direction=d) for d in ("in", "out")}
    moved = {d: run.total(f"{P}migration_bytes_total", direction=d) for d in ("in", "out")}
    assert streams["in"] == streams["out"] and moved["in"] == moved["out"], (streams, moved)
    assert (moved["in"] > 0) == (streams["in"] > 0)
    assert len(run.now(f"{P}migration_failures_total")) == 2
    assert run.total(f"{P}migration_failures_total") == 0
    assert sorted(run.now(f"{P}worker_draining", policy="affinity")) == [0.0, 0.0]


def test_disagg_metrics(run):
    """The handed-off request: one hand-off moved (its time and bytes observed), every
    outcome and local-prefill reason exported from the start; its first token's time counted
    on the prefill worker, its time per token on the decode worker."""
    assert run.total(f"{P}disagg_handoffs_total", outcome="moved") == 1
    assert run.total(f"{P}disagg_handoffs_total") == 1
    assert len({lab for n, lab in run.after if n == f"{P}disagg_handoffs_total"}) == 6
    assert len({lab for n, lab in run.after if n == f"{P}disagg_local_prefills_total"}) == 5
    assert run.total(f"{P}disagg_handoff_seconds_count") == 1
    assert run.total(f"{P}disagg_handoff_seconds_sum") > 0
    assert run.total(f"{P}disagg_handoff_bytes_count") == 1
    assert run.total(f"{P}disagg_handoff_bytes_sum") > 0
    assert run.total(f"{P}router_decisions_total", kind="disaggregated") == 1
    assert run.total(f"{P}time_to_first_token_seconds_count", role="prefill",
                     worker="worker-0") == 1
    assert run.total(f"{P}time_per_output_token_seconds_count", role="decode",
                     worker="worker-1") == 1
    assert run.total(f"{P}time_to_first_token_seconds_count", role="mixed") == \
        run.total(f"{P}time_to_first_token_seconds_count") - 1


def _dashboard_metric_names() -> Callable:
    spec = importlib.util.spec_from_file_location("dashboard_metrics", DASHBOARD_PARSER)
    assert spec and spec.loader, f"{DASHBOARD_PARSER} is missing"
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.dashboard_metric_names


def test_dashboard_uses_only_exported_metrics(run):
    assert DASHBOARD.is_file(), f"{DASHBOARD} is missing"
    used = _dashboard_metric_names()(DASHBOARD)
    exported = run.names | {n.rsplit("_", 1)[0] for n in run.names
                            if n.endswith(("_bucket", "_sum", "_count"))}
    assert used, "the dashboard's queries name no metric"
    assert not used - exported, f"the dashboard queries metrics nobody exports: {sorted(used - exported)}"
