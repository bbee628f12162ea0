"""Restore or recompute, by cost, end to end (tiny random model, float32 greedy): the outputs
equal the unconstrained run's whichever way parked streams come back (forced through
`host_restore_policy`, or through the cost model's figures, so nothing depends on this
machine's speed), each restore's decision and reason is counted, the choice also steers
write-backs and demotions, and the start-up calibration leaves the engine as new."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from engine_runs import run_to_end
from tiny_models import tiny_model_path

from kvserve import LLM, SamplingParams
from kvserve.kvcache.restore_cost import RestoreCost
from kvserve.workers.engine.engine import LLMEngine

BS = 4
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


def workload(n: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(6, 40))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def llm(path: str, device: str, **kw) -> LLM:
    base = {"kv_cache_tokens": 96, "block_size": BS, "host_cache_gib": 0.01, "max_num_seqs": 24,
            "admission_lookahead_tokens": 0, "device": device, "dtype": "float32"}
    return LLM(path, **{**base, **kw})


@pytest.fixture(scope="module")
def reference(tiny):
    cache: dict[str, list[list[int]]] = {}

    def get(device: str) -> list[list[int]]:
        if device not in cache:
            full = llm(tiny, device, kv_cache_tokens=8192, host_cache_gib=0)
            cache[device] = [o.token_ids for o in full.generate(workload(), GREEDY)]
        return cache[device]

    return get


def pin(cost: RestoreCost, copy_cheaper: bool) -> None:
    """Fix the cost model's figures so one side always wins (the moving averages off)."""
    cost.observe_copy = lambda *a: None  # type: ignore[method-assign]
    cost.observe_prefill = lambda *a: None  # type: ignore[method-assign]
    if copy_cheaper:  # free copies, a second per recomputed token
        for d in ("out", "in"):
            cost.set_copy(d, 1e-15, 0.0)
        cost.s_per_token = 1.0
    else:  # a second per byte copied, recomputing free
        for d in ("out", "in"):
            cost.set_copy(d, 1.0, 1.0)
        cost.s_per_token = 1e-12


def run(eng: LLMEngine, prompts: list[list[int]], on_step=None) -> list[list[int]]:
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    got = run_to_end(eng, on_step)
    return [got[i] for i in ids]


def assert_clean(eng: LLMEngine) -> None:
    eng.check_invariants()
    assert eng.kv.streams == {} and eng.kv.held == {} and eng.kv.pool.num_used == 0
    assert eng.kv.host is None or eng.kv.host.num_used == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("how", ["policy_copy", "policy_recompute", "cost_copy", "cost_recompute"])
def test_outputs_equal_unconstrained_whichever_way_streams_come_back(tiny, reference, device,
                                                                     async_scheduling, how):
    kind, way = how.split("_")
    eng = llm(tiny, device, async_scheduling=async_scheduling,
              host_restore_policy=way if kind == "policy" else "cost").engine
    host = eng.kv.host
    assert host is not None
    if kind == "cost":
        pin(host.cost, copy_cheaper=way == "copy")
    assert run(eng, workload()) == reference(device)
    s = eng.stats()
    assert s["evictions"] > 0 and s["restores"] == s["evictions"]
    reason = "policy" if kind == "policy" else f"cheaper_to_{way}"
    other = "recompute" if way == "copy" else "copy"
    # every restore that had something to bring back was decided one way, for that reason
    assert s[f"restores_{way}"] == s[f"restores_{way}_{reason}"] > 0
    assert s[f"restores_{other}"] == 0
    assert s["restores_copy"] + s["restores_recompute"] <= s["restores"]
    if way == "copy":
        assert s["tokens_restored_copy"] > 0 and s["tokens_recomputed"] == 0
        assert s["writebacks_skipped"] == 0 and s["demotions_skipped"] == 0
        assert host.copier.blocks["out"] > 0 and host.copier.blocks["in"] > 0
    else:  # the host tier copies nothing at all: no write-back, no demotion, no restore
        assert s["tokens_restored_copy"] == 0 and s["tokens_recomputed"] > 0
        assert s["writebacks_skipped"] == s["evictions"] and s["demotions_skipped"] > 0
        assert host.copier.blocks == {"out": 0, "in": 0} and host.blocks_written == 0
    assert_clean(eng)


def test_the_choice_is_made_again_when_a_stream_comes_back(tiny, reference):
    """Written back while copies were cheaper, recomputed once they are not: the stream's host
    blocks are dropped (unpinned), the reason is counted, the output is the same."""
    eng = llm(tiny, "cpu").engine
    host = eng.kv.host
    assert host is not None
    pin(host.cost, copy_cheaper=True)

    def flip(e: LLMEngine) -> None:
        if e.stats()["evictions"] > 0 and host.cost.s_per_token == 1.0:
            pin(host.cost, copy_cheaper=False)

    assert run(eng, workload(), flip) == reference("cpu")
    s = eng.stats()
    assert host.copier.blocks["out"] > 0  # the first evictions were written back
    assert s["restores_recompute_cheaper_to_recompute"] > 0 and s["tokens_recomputed"] > 0
    assert s["writebacks_skipped"] > 0  # the later ones were not
    assert_clean(eng)


def test_nothing_on_host_is_counted_as_such(tiny, reference):
    # one host block: most parked streams keep nothing there
    one_block = llm(tiny, "cpu", host_cache_gib=0).engine.runner.cache.bytes_per_block / 2**30
    eng = llm(tiny, "cpu", host_cache_gib=one_block, host_restore_policy="copy").engine
    assert eng.kv.host is not None and eng.kv.host.num_blocks == 1
    assert run(eng, workload()) == reference("cpu")
    s = eng.stats()
    assert s["restores_recompute_not_on_host"] > 0 and s["tokens_recomputed"] > 0
    assert_clean(eng)
    # no host tier at all: every restore that recomputes says so, and the figures are zeros
    off = llm(tiny, "cpu", host_cache_gib=0).engine
    assert run(off, workload()) == reference("cpu")
    s = off.stats()
    assert s["restores_recompute_not_on_host"] == s["restores_recompute"] > 0
    assert s["restores_copy"] == 0
    assert s["host_copy_gbps_d2h"] == s["host_copy_gbps_h2d"] == s["prefill_tokens_per_s"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_calibration_measures_at_start_up_and_leaves_the_engine_as_new(tiny, device):
    eng = llm(tiny, device, kv_cache_tokens=256).engine
    s = eng.stats()
    assert s["host_copy_gbps_d2h"] > 0 and s["host_copy_gbps_h2d"] > 0 and s["prefill_tokens_per_s"] > 0
    assert host_untouched(eng)
    assert s["copy_bytes"] == 0 and s["restored_blocks"] == 0 and eng.kv.prefix_queries == 0
    rid = eng.add_request(list(range(200, 213)), GREEDY)
    eng.step()
    assert eng.kv.block_table(rid) == [0, 1, 2, 3]  # blocks handed out as by a new pool


def host_untouched(eng: LLMEngine) -> bool:
    host = eng.kv.host
    assert host is not None
    return (eng.kv.pool.num_free == eng.kv.num_blocks and not eng.kv.pool.cached
            and host.table.num_free == host.num_blocks and not host.table.cached)


def test_snapshot_from_a_copying_engine_recomputed_by_policy(tiny, reference):
    p = workload()[3]
    want = reference("cpu")[3]
    src = llm(tiny, "cpu", kv_cache_tokens=1024, host_restore_policy="copy").engine
    rid = src.add_request(p, GREEDY)
    while len(src.seqs[rid].output_ids) < 5:
        src.step()
    data = src.export_stream(rid)
    dst = llm(tiny, "cpu", kv_cache_tokens=1024, host_restore_policy="recompute").engine
    dst.import_stream(data)
    out = None
    while dst.has_unfinished():
        for o in dst.step():
            out = o
    assert out is not None and out.token_ids == want
    s = dst.stats()
    assert s["restores_recompute_policy"] == 1 and s["tokens_restored_copy"] == 0
    assert_clean(dst)


def recorded_worker_metrics(monkeypatch) -> tuple[Any, list[tuple[str, str, float, dict]]]:
    """A WorkerMetrics whose Ray metrics record their calls: (it, the calls)."""
    import ray.util.metrics as rm

    from kvserve.workers import metrics

    log: list[tuple[str, str, float, dict]] = []

    class Metric:
        def __init__(self, name: str, *a, **kw) -> None:
            self.name = name

        def set_default_tags(self, tags: dict) -> Metric:
            return self

        def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
            log.append(("inc", self.name, value, tags or {}))

        def set(self, value: float, tags: dict | None = None) -> None:
            log.append(("set", self.name, value, tags or {}))

        def _record(self, value: float, tags: dict | None = None) -> None:
            log.append(("zero", self.name, value, tags or {}))

        observe = inc

    monkeypatch.setattr(metrics, "_in_actor", lambda: True)
    for name in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(rm, name, Metric)
    return metrics.WorkerMetrics("tiny", "worker-0"), log


def test_worker_metrics_export_decisions_and_figures(monkeypatch):
    """WorkerMetrics.poll turns the engine's decision counts into counter increments by
    (decision, reason), and the measured figures into gauges by direction."""
    m, log = recorded_worker_metrics(monkeypatch)
    zeroed = {tuple(sorted(t.items())) for k, n, _, t in log if k == "zero" and n == "kvserve_kv_restores"}
    assert len(zeroed) == 6  # every (decision, reason) exported from the start
    stats = {"restores_copy_cheaper_to_copy": 3, "restores_recompute_policy": 1,
             "writebacks_skipped": 2, "host_copy_gbps_d2h": 12.5, "host_copy_gbps_h2d": 25.0,
             "prefill_tokens_per_s": 900.0}
    log.clear()
    m.poll(stats, 0)
    stats["restores_copy_cheaper_to_copy"] = 5
    m.poll(stats, 0)
    incs = [(v, t) for k, n, v, t in log if k == "inc" and n == "kvserve_kv_restores"]
    assert incs == [(3.0, {"decision": "copy", "reason": "cheaper_to_copy"}),
                    (1.0, {"decision": "recompute", "reason": "policy"}),
                    (2.0, {"decision": "copy", "reason": "cheaper_to_copy"})]
    assert ("inc", "kvserve_kv_writebacks_skipped", 2.0, {}) in log
    assert ("set", "kvserve_kv_host_copy_gbps", 25.0, {"direction": "h2d"}) in log
    assert ("set", "kvserve_prefill_tokens_per_s", 900.0, {}) in log


def test_recomputed_tokens_reach_the_worker_metric(monkeypatch, tmp_path_factory):
    """A run that recomputes (no host tier: every eviction is recomputed) counts the tokens in
    the engine's stats, and WorkerMetrics.poll exports exactly that growth."""
    from engine_runs import run_to_end
    from tiny_models import tiny_model_path

    from kvserve import LLM, SamplingParams

    m, log = recorded_worker_metrics(monkeypatch)
    # four streams whose answers do not fit the 24-block pool together: some are evicted
    eng = LLM(tiny_model_path(tmp_path_factory), kv_cache_tokens=24 * 4, block_size=4,
              host_cache_gib=0, admission_lookahead_tokens=0).engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        eng.add_request([100 + 7 * i + j for j in range(12)], params)
    run_to_end(eng, lambda e: m.poll(e.stats(), 0))
    recomputed = eng.stats()["tokens_recomputed"]
    assert eng.stats()["evictions"] > 0 and recomputed > 0
    assert sum(v for k, n, v, _ in log
               if k == "inc" and n == "kvserve_kv_recomputed_tokens") == recomputed
