"""The Grafana dashboard (helm/kvserve/dashboards/kvserve.json) and its metric-name parser."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dashboard_metrics import (  # noqa: E402
    dashboard_metric_names,
    promql_metric_names,
    strip_histogram_suffix,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "kvserve" / "dashboards" / "kvserve.json"

# the names kvserve exports as Ray 2.60 writes them: a ray_ prefix, and _total on counters
# (tests/deploy/test_metrics.py checks the dashboard against a real scrape)
WORKER_METRICS = {
    "ray_kvserve_requests_received_total", "ray_kvserve_requests_finished_total",
    "ray_kvserve_requests_running", "ray_kvserve_requests_waiting",
    "ray_kvserve_time_to_first_token_seconds", "ray_kvserve_time_per_output_token_seconds",
    "ray_kvserve_e2e_request_latency_seconds", "ray_kvserve_queue_wait_seconds",
    "ray_kvserve_prompt_tokens_total", "ray_kvserve_generation_tokens_total",
    "ray_kvserve_prefix_cache_hit_tokens_total",
    "ray_kvserve_kv_device_blocks_used", "ray_kvserve_kv_device_blocks_capacity",
    "ray_kvserve_kv_host_blocks_used", "ray_kvserve_kv_host_blocks_capacity",
    "ray_kvserve_streams_running", "ray_kvserve_streams_parked",
    "ray_kvserve_kv_evictions_total", "ray_kvserve_kv_restored_blocks_total", "ray_kvserve_kv_restored_bytes_total",
    "ray_kvserve_kv_recomputed_tokens_total", "ray_kvserve_kv_host_copy_seconds_total",
    "ray_kvserve_kv_restores_total", "ray_kvserve_kv_writebacks_skipped_total",
    "ray_kvserve_kv_host_copy_gbps", "ray_kvserve_prefill_tokens_per_s",
    "ray_kvserve_spec_decode_drafts_total", "ray_kvserve_spec_decode_draft_tokens_total",
    "ray_kvserve_spec_decode_accepted_tokens_total",
}
INGRESS_METRICS = {"ray_kvserve_requests_rejected_total"}
ROUTER_METRICS = {"ray_kvserve_router_decisions_total", "ray_kvserve_router_retries_total",
                  "ray_kvserve_router_workers_alive", "ray_kvserve_migration_streams_total",
                  "ray_kvserve_migration_bytes_total", "ray_kvserve_migration_failures_total",
                  "ray_kvserve_migration_sessions_total", "ray_kvserve_worker_draining",
                  "ray_kvserve_stream_moves_total", "ray_kvserve_stream_move_stall_seconds",
                  "ray_kvserve_stream_move_rounds", "ray_kvserve_autoscaler_desired_workers",
                  "ray_kvserve_autoscaler_workers", "ray_kvserve_autoscaler_decisions_total",
                  "ray_kvserve_autoscaler_cold_start_seconds",
                  "ray_kvserve_autoscaler_pressure_to_serving_seconds",
                  "ray_kvserve_autoscaler_queued_requests", "ray_kvserve_disagg_handoffs_total",
                  "ray_kvserve_disagg_handoff_seconds", "ray_kvserve_disagg_handoff_bytes",
                  "ray_kvserve_disagg_local_prefills_total"}
EXPORTED = WORKER_METRICS | INGRESS_METRICS | ROUTER_METRICS


def test_dashboard_uses_only_exported_metrics():
    used = dashboard_metric_names(DASHBOARD)
    assert used <= EXPORTED, used - EXPORTED
    assert used == EXPORTED, EXPORTED - used  # and shows every one of them


def test_dashboard_structure():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"model", "worker"} <= set(variables)
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Traffic", "Latency", "KV cache", "Router", "Autoscaling", "Migration",
                    "Disaggregated serving", "Per-worker load", "Speculative decoding"]
    exprs = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        exprs += [t["expr"] for t in panel["targets"]]
    quantiles = [e for e in exprs if e.startswith("histogram_quantile(")]
    for m in ("time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert any(f"({q}, " in e and f"ray_kvserve_{m}_bucket" in e and "rate(" in e
                       for e in quantiles), (m, q)
    # counters are only ever rated, never shown raw
    for e in exprs:
        for n in promql_metric_names(e):
            if n.endswith("_total"):
                assert f"rate({n}" in e or f"increase({n}" in e, (n, e)
    worker_exprs = [e for e in exprs if any(m in e for m in WORKER_METRICS)]
    assert all('worker=~"$worker"' in e and 'model=~"$model"' in e for e in worker_exprs)
    # the latencies by the workers' role (disaggregated serving: prefill and decode)
    for m in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert any(f"ray_kvserve_{m}_bucket" in e and "by (le, role)" in e for e in quantiles), m


def test_dashboard_metric_names_parser(tmp_path):
    assert strip_histogram_suffix("a_seconds_bucket") == "a_seconds"
    assert strip_histogram_suffix("a_count") == "a" and strip_histogram_suffix("a_total") == "a_total"
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, worker) '
        '(rate(lat_seconds_bucket{model=~"$model", le!="+Inf"}[$__rate_interval])))'
    ) == {"lat_seconds_bucket"}
    assert promql_metric_names(
        "sum(rate(a_total[5m] offset 1h)) / ignoring(reason) group_left(x) b > bool 0.5e3"
    ) == {"a_total", "b"}
    assert promql_metric_names('max_over_time(rec:rule:rate5m[1h:5m]) and on(pod) up') == {
        "rec:rule:rate5m", "up"}
    assert promql_metric_names('count({__name__="by_name", job="x"})') == {"by_name"}
    dash = {
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "query": "prometheus"},
            {"type": "query", "name": "m", "query": {"query": 'label_values(v_gauge{a="1"}, model)'}},
            {"type": "query", "name": "w", "definition": "query_result(topk(3, w_seconds_sum))"},
        ]},
        "panels": [
            {"type": "timeseries", "targets": [{"expr": "sum(rate(x_seconds_count[1m]))"}]},
            {"type": "row", "panels": [
                {"type": "stat", "targets": [{"expr": "y_bytes / on() z_total"}, {"refId": "B"}]}]},
        ],
    }
    path = tmp_path / "d.json"
    path.write_text(json.dumps(dash))
    assert dashboard_metric_names(path) == {"v_gauge", "w_seconds", "x_seconds", "y_bytes",
                                            "z_total"}
