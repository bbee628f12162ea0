"""`kvserve serve` with a GPU worker answers gRPC and HTTP with the greedy text of the offline
engine on the same GPU (skipped where torch sees no CUDA GPU).

The app is configured from `kvserve serve --gpus-per-worker 1 --dtype float32` arguments.
Where the session's CPU app already runs (the whole suite), it runs beside it as an app of
its own: its own router, HTTP route and gRPC `application` name, the same Serve proxies.
Alone (this file only), it is deployed as `kvserve serve` deploys, in a Ray of its own, and
needs no default model: `KVSERVE_CUDA_TEST_MODEL` (an HF directory with its tokenizer) picks
the model, else the default one. float32 because bf16 greedy tokens may differ between
batch shapes."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from serve_fixtures import API_KEY, ServeApp, free_port
from served_checks import check_grpc_greedy, check_http_greedy, offline_texts

from kvserve.protos import kvserve_pb2_grpc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

APP, ROUTER = "kvserve-gpu", "kvserve-router-gpu"
DEVICE = "cuda"
SERVE_ARGS = ["--gpus-per-worker", "1", "--dtype", "float32", "--kv-cache-tokens", "4096",
              "--max-model-len", "1024"]


@dataclass
class RoutedApp(ServeApp):
    """An app served under its own route prefix."""

    route: str = ""

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}{self.route}"


@pytest.fixture(scope="module")
def gpu_app(request) -> Iterator[tuple[RoutedApp, dict[str, str]]]:
    import ray
    from ray import serve

    from kvserve import LLM
    from kvserve.cli import build_parser
    from kvserve.deploy.app import APP_NAME, build_app
    from kvserve.deploy.serve_cli import config_from_args, deploy, shutdown
    from kvserve.models import default_model
    from kvserve.router.lifecycle import kill_router
    from kvserve.router.router import NAMESPACE

    beside = ray.is_initialized()  # the session's app is up: share its Ray and proxies
    session = request.getfixturevalue("serve_app") if beside else None
    ports = (session.grpc_port, session.http_port) if session else (free_port(), free_port())
    model = os.environ.get("KVSERVE_CUDA_TEST_MODEL") or default_model()
    cfg = config_from_args(build_parser().parse_args([
        "serve", "--model", model, *SERVE_ARGS, "--grpc-port", str(ports[0]),
        "--http-port", str(ports[1]), "--api-key", API_KEY]))
    if beside:
        cfg = cfg.model_copy(update={"router_name": ROUTER})
        app_name, route = APP, f"/{APP}"
        serve.run(build_app(cfg), name=app_name, route_prefix=route)
    else:
        app_name, route = APP_NAME, ""
        deploy(cfg, ray_init={"include_dashboard": False, "log_to_driver": False},
               start_timeout_s=900)
    try:
        app = RoutedApp(ports[0], ports[1], API_KEY,
                        ray.get_actor(cfg.router_name, namespace=NAMESPACE), cfg,
                        metadata=(("authorization", f"Bearer {API_KEY}"),
                                  ("application", app_name)), route=route)
        deadline = time.monotonic() + 600  # model load and CUDA graph capture
        while any(w["state"] != "ready" for w in app.server_info()["workers"]):
            assert time.monotonic() < deadline, app.server_info()["workers"]
            time.sleep(1)
        llm = LLM(model, device=DEVICE, dtype="float32", kv_cache_tokens=4096, max_model_len=1024)
        yield app, offline_texts(llm)
        del llm
    finally:
        if not beside:
            shutdown(cfg)
        else:
            if APP in serve.status().applications:
                serve.delete(APP)
            kill_router(ROUTER)


def test_grpc_matches_the_offline_engine_on_the_gpu(gpu_app):
    app, offline = gpu_app
    with grpc.insecure_channel(app.grpc_target) as ch:
        check_grpc_greedy(app, kvserve_pb2_grpc.KVServeStub(ch), offline, DEVICE)


def test_http_matches_the_offline_engine_on_the_gpu(gpu_app):
    app, offline = gpu_app
    check_http_greedy(app, offline)

