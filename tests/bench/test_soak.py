"""`kvserve bench soak`: a short soak with a worker killed midway keeps its invariants."""

from __future__ import annotations

import pytest

from kvserve.bench.soak import format_report, parse_chaos, run_soak


def test_chaos_events_parse_and_bad_ones_are_refused():
    assert parse_chaos("router@20, worker@10", 60) == [(10.0, "worker"), (20.0, "router")]
    for bad in ("disk@10", "worker", "worker@70"):
        with pytest.raises(ValueError):
            parse_chaos(bad, 60)


@pytest.mark.slow
def test_short_soak_with_a_worker_kill(serve_app):
    serve_app.wait_all_alive()
    r = run_soak(serve_app.http_url, serve_app.grpc_target, serve_app.api_key, duration=36,
                 concurrency=4, chaos=[(12.0, "worker")], max_tokens=16, sample_s=2.0)
    print(format_report(r))
    assert r["requests"] >= 8 and r["by_status"].get("ok", 0) >= 4  # a loaded 2-core machine
    assert r["bad_inputs_not_4xx"] == 0
    assert r["server_errors_outside_chaos"] == 0, r["server_error_examples"]
    (e,) = r["chaos"]
    # a stream cut by the kill gets UNAVAILABLE (gRPC) / 503 (HTTP) with a clear message;
    # requests without a first token were retried on the other worker, not failed
    assert set(e["failed_by_status"]) <= {"grpc_UNAVAILABLE", "http_503"}, e
    assert all("mid-stream" in m for m in e["failure_examples"]), e
    assert r["idle"]["clean"], r["idle"]  # no slot, KV block or stream left once idle
    assert r["rss_mib"] and all(k.split(":")[0] in
                                {"controller", "proxy", "ingress", "router", "worker", "gcs",
                                 "raylet", "idle_worker"} for k in r["rss_mib"])
    serve_app.wait_all_alive(timeout=120)


def test_report_from_synthetic_outcomes():
    """The report's arithmetic: windows, failures by status around a chaos event, RSS growth."""
    from kvserve.bench.soak import build_report
    from kvserve.bench.soak_load import Outcome

    t0 = 1000.0
    outs = [Outcome("http_stream", t0 + t, t0 + t + 1, "ok", ttft=0.1 + (t > 500) * 0.1)
            for t in range(0, 600, 2)]
    outs.append(Outcome("grpc_stream", t0 + 299, t0 + 301, "grpc_UNAVAILABLE",
                        message="worker worker-0 died mid-stream after 3 tokens were sent"))
    outs.append(Outcome("bad_http", t0 + 10, t0 + 11, "http_400", expected_error=True))
    samples = [{"t": t, "rss_mib": {"worker:1": 100 + t / 100}, "ingress_retries": t // 300,
                "workers": [{"kv_used": 0, "kv_total": 64, "host_used": 0, "evictions": 0,
                             "parked": 0, "inflight": 1}]} for t in range(0, 600, 5)]
    events = [{"what": "worker", "at_s": 300.0, "killed": "w", "client_in_flight": 3,
               "router_in_flight": 3}]
    r = build_report(outs, samples, events, {"clean": True}, t0, 600)
    (e,) = r["chaos"]
    assert e["failed_by_status"] == {"grpc_UNAVAILABLE": 1} and e["recovery_s"] is not None
    assert e["retries"] == 1
    assert r["server_errors"] == 1 and r["server_errors_outside_chaos"] == 0
    assert r["ttft_ms"]["first_window"]["p99_ms"] == 100.0
    assert r["ttft_ms"]["last_window"]["p99_ms"] == 200.0
    assert 2.0 <= r["rss_mib"]["worker:1"]["growth_mib"] <= 4.0
    assert r["verdict"]["ok"]
