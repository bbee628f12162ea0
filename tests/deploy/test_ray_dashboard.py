"""What an operator sees of a running `kvserve serve --workers 2`: the banner names the
metrics endpoint and the Ray dashboard (and how to get its token), GetServerInfo reports the
same, the metrics port serves kvserve's series, the dashboard lists the router and both
workers by name with their repr (its state API, and its Actors page in headless Chromium
after its token dialog), and kvserve's Grafana dashboard lies beside Ray's own.

One server for the module; the last test stops it as systemd's `KillMode=control-group`
does: SIGTERM to its whole process group, the Ray processes included."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest
import serve_process
from serve_process import ServeProcess, http_json, http_text

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

pytestmark = pytest.mark.slow  # the heavy tier (README: the two commands)

ROOT = Path(__file__).resolve().parents[2]
CHART_DASHBOARD = ROOT / "helm" / "kvserve" / "dashboards" / "kvserve.json"
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the default model's served name
WORKERS = ("kvserve-worker-0", "kvserve-worker-1")
STOP_MARGIN_S = 10.0
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# headless Chromium without a sandbox (root in a container), GPU, or calls home
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync")


@pytest.fixture(scope="module")
def served():
    sp = ServeProcess(workers=2, grace_s=10.0)
    try:
        sp.banner = sp.wait_ready()
        yield sp
    finally:
        sp.kill()


@pytest.fixture(scope="module")
def ray_token(served) -> str:
    """The token, as the banner says to get it."""
    return serve_process.ray_token()


def _dashboard(served) -> str:
    return served.banner["dashboard"]


def test_banner_and_server_info_say_where_metrics_and_dashboard_are(served):
    assert served.banner["grpc"] == f"127.0.0.1:{served.grpc_port}"
    assert served.banner["metrics"] == f"http://127.0.0.1:{served.metrics_port}/metrics"
    assert _dashboard(served) == f"http://127.0.0.1:{served.dashboard_port}"
    line = served.wait_for_line(r"^  dashboard .*", timeout=1).group(0)
    assert "ray get-auth-token" in line, line  # Ray runs with token authentication
    with grpc.insecure_channel(served.banner["grpc"]) as ch:
        info = kvserve_pb2_grpc.KVServeStub(ch).GetServerInfo(pb.GetServerInfoRequest(),
                                                               timeout=60)
    assert info.metrics_port == served.metrics_port
    assert info.dashboard_url == _dashboard(served)
    assert [w.worker_id for w in info.workers] == ["worker-0", "worker-1"]


def test_the_announced_metrics_port_serves_kvserve_series(served):
    with grpc.insecure_channel(served.banner["grpc"]) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        stub.Generate(pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(
            temperature=0, max_tokens=4)), timeout=300)
    # from the worker, the router and the ingress: each process reports every 10 s
    wanted = {"ray_kvserve_requests_received_total", "ray_kvserve_requests_running",
              "ray_kvserve_router_workers_alive", "ray_kvserve_requests_rejected_total"}
    deadline = time.monotonic() + 180
    while True:
        text = http_text(served.banner["metrics"])
        series = {ln.split("{")[0] for ln in text.splitlines() if ln.startswith("ray_kvserve_")}
        if wanted <= series:
            break
        assert time.monotonic() < deadline, (sorted(wanted - series), sorted(series))
        time.sleep(1)


def test_dashboard_state_api_lists_the_router_and_named_workers(served, ray_token):
    url = _dashboard(served) + "/api/v0/actors?detail=true&limit=1000"
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as e:
        http_json(url)  # token authentication is on
    assert e.value.code in (401, 403)
    actors = http_json(url, {"Authorization": f"Bearer {ray_token}"})["data"]["result"]["result"]
    alive = {a["name"]: a for a in actors if a.get("name") and a["state"] == "ALIVE"}
    router = alive["kvserve-router"]
    assert router["ray_namespace"] == "kvserve"
    assert router["repr_name"].startswith("RouterActor(kvserve-router, model=" + MODEL), router
    for i, name in enumerate(WORKERS):
        assert name in alive, sorted(alive)
        w = alive[name]
        assert w["class_name"] == "WorkerActor" and w["ray_namespace"] == "kvserve"
        assert w["repr_name"] == f"WorkerActor(worker-{i}, model={MODEL}, device=cpu)", w


def test_kvserve_grafana_dashboard_lies_beside_rays_own(served, ray_token):
    version = http_json(_dashboard(served) + "/api/version",
                        {"Authorization": f"Bearer {ray_token}"})
    folder = Path("/tmp/ray") / version["session_name"] / "metrics" / "grafana" / "dashboards"
    ours = folder / "kvserve_grafana_dashboard.json"
    deadline = time.monotonic() + 120  # the ingress writes it in the background
    while not ours.exists():
        assert time.monotonic() < deadline, sorted(p.name for p in folder.glob("*"))
        time.sleep(0.5)
    assert (folder / "default_grafana_dashboard.json").exists()  # Ray's, from the same run
    assert ours.read_bytes() == CHART_DASHBOARD.read_bytes()  # the chart's, unchanged


def _browser():
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        if os.environ.get("KVSERVE_REQUIRE_BROWSER"):  # CI: it must run, not skip
            pytest.fail(f"{CHROMIUM} or {CHROMEDRIVER} is missing")
        pytest.skip("the browser test needs Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver; .ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    return opts, Service(executable_path=CHROMEDRIVER), webdriver


def test_browser_logs_in_with_the_token_and_finds_both_workers(served, ray_token, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    opts, service, webdriver = _browser()
    opts.add_argument(f"--user-data-dir={tmp_path / 'chromium'}")  # a fresh profile
    driver = webdriver.Chrome(options=opts, service=service)
    try:
        wait = WebDriverWait(driver, 120)
        driver.get(_dashboard(served) + "/#/actors")
        # Ray's dialog: "Authentication Token Required", a password field, SUBMIT
        field = wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "input[type=password]")))
        field.send_keys(ray_token)
        wait.until(ec.element_to_be_clickable(
            (By.XPATH, "//button[translate(normalize-space(), 'submit', 'SUBMIT')='SUBMIT']"))
        ).click()
        wait.until(lambda d: all(n in d.find_element(By.TAG_NAME, "body").text
                                 for n in WORKERS))
        rows = driver.find_element(By.TAG_NAME, "body").text.splitlines()
        for i, name in enumerate(WORKERS):  # the name and the repr, in the worker's row
            assert any(name in r and f"WorkerActor(worker-{i}, model={MODEL}" in r
                       for r in rows), [r for r in rows if "kvserve" in r]
        assert any("kvserve-router" in r and "RouterActor(" in r for r in rows)
    finally:
        driver.quit()


def test_a_signal_to_the_whole_process_group_stops_it(served):
    """Last: the Ray processes get the same SIGTERM; the command must not wait for them."""
    served.signal(signal.SIGTERM, group=True)
    rc = served.wait_exit(served.grace_s + STOP_MARGIN_S)
    print(served.output)  # its timeline, shown with a failure
    assert rc == 0, f"exit status {rc}:\n{served.output[-6000:]}"
    busy = {k: p for k, p in served.busy_ports().items() if k in ("gRPC", "HTTP")}
    assert not busy, busy
    assert not served.left_running(), served.left_running()
