"""`kvserve generate --server`, the Serve config YAML, the builder and ServeConfig."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvserve.deploy.config import ServeConfig
from kvserve.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def test_generate_against_server_streams_offline_text(serve_app, smol_llm, capsys):
    from kvserve.cli import main

    prompt = "The capital of France is"
    rc = main(["generate", "--server", serve_app.grpc_target, "--api-key", serve_app.api_key,
               "--prompt", prompt, "--max-tokens", "10"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    expect = smol_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].text
    assert out == expect + "\n"
    assert "served by worker-" in err

    rc = main(["generate", "--server", serve_app.grpc_target, "--prompt", prompt])
    assert rc == 1 and "UNAUTHENTICATED" in capsys.readouterr().err


def test_serve_config_yaml_is_valid_for_serve_and_kvserve():
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema(**doc)
    app = doc["applications"][0]
    cfg = ServeConfig(**app["args"])
    assert cfg.grpc_port == schema.grpc_options.port and cfg.http_port == schema.http_options.port
    from ray.serve.config import gRPCOptions

    fns = gRPCOptions(grpc_servicer_functions=doc["grpc_options"]["grpc_servicer_functions"])
    assert len(fns.grpc_servicer_func_callable) == 1
    from kvserve.deploy.app import build_app

    assert build_app({**app["args"], "num_workers": "2"}) is not None  # serve run passes strings


def test_serve_config_api_keys_and_engine(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEYS", "k2, k3")
    cfg = ServeConfig(api_keys="k1,k2", engine={"num_threads": 1})
    assert cfg.resolved_api_keys() == ["k1", "k2", "k3"]
    assert cfg.engine_config().num_threads == 1
    with pytest.raises(ValueError):
        ServeConfig(engine={"kv_cache_tokenz": 5})
    with pytest.raises(ValueError):
        ServeConfig(num_workers=0)
    with pytest.raises(ValueError):
        ServeConfig(stream_interval_ms=-1)


def test_cpu_workers_share_the_cores_unless_threads_are_set():
    # a Ray actor would otherwise run torch on OMP_NUM_THREADS = num_cpus = 1 thread
    assert ServeConfig(num_workers=1).worker_engine(8)["num_threads"] == 8
    assert ServeConfig(num_workers=3).worker_engine(8)["num_threads"] == 2
    assert ServeConfig(num_workers=4).worker_engine(2)["num_threads"] == 1
    assert ServeConfig(engine={"num_threads": 3}).worker_engine(8)["num_threads"] == 3
    assert ServeConfig(num_gpus_per_worker=1).worker_engine(8)["num_threads"] is None


def test_cpu_host_ray_defaults_leave_set_variables_alone(monkeypatch):
    import os

    from kvserve.deploy.ray_tuning import CPU_HOST_RAY_ENV, apply_cpu_host_defaults

    for k in CPU_HOST_RAY_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")  # the operator's choice
    applied = apply_cpu_host_defaults()
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in applied
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"
    assert set(applied) == set(CPU_HOST_RAY_ENV) - {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S"}
    assert all(os.environ[k] == v for k, v in applied.items())
    assert apply_cpu_host_defaults() == {}  # idempotent


def test_start_up_waits_through_timeouts_and_says_what_it_waited_for():
    import time

    from kvserve.deploy.serve_cli import _until_ready

    calls = []

    def slow_twice():
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("Proxies not available after 60s.")

    _until_ready(slow_twice, "the proxies", time.monotonic() + 60)
    assert len(calls) == 3

    from ray.exceptions import ActorDiedError

    def proxy_killed_once():  # the controller killed a proxy too slow to answer its checks
        calls.append(1)
        if len(calls) < 5:
            raise ActorDiedError()

    _until_ready(proxy_killed_once, "the proxies", time.monotonic() + 60)
    assert len(calls) == 5

    def never():
        raise TimeoutError("Proxies not available after 60s.")

    with pytest.raises(TimeoutError, match="gave up waiting for the proxies.*KVSERVE_START_TIMEOUT_S"):
        _until_ready(never, "the proxies", time.monotonic() - 1)


def test_gpus_per_worker_reaches_the_worker_actors_and_their_device():
    from kvserve.cli import build_parser
    from kvserve.deploy.serve_cli import config_from_args
    from kvserve.workers.worker_actor import worker_options

    a = build_parser().parse_args(["serve", "--workers", "2", "--gpus-per-worker", "0.5"])
    cfg = config_from_args(a)
    assert cfg.num_gpus_per_worker == 0.5  # two workers share one GPU
    rc = cfg.router_config()
    assert worker_options(rc.num_cpus_per_worker, rc.num_gpus_per_worker)["num_gpus"] == 0.5
    assert rc.worker_engine(8)["device"] == "cuda"  # the GPU Ray gives the actor
    f32 = config_from_args(build_parser().parse_args(["serve", "--gpus-per-worker", "1",
                                                      "--dtype", "float32"]))
    engine = f32.router_config().worker_engine(8)
    assert (engine["device"], engine["dtype"], engine["num_threads"]) == ("cuda", "float32", None)
    cpu = config_from_args(build_parser().parse_args(["serve", "--gpus-per-worker", "0"]))
    assert cpu.router_config().worker_engine(8)["device"] == "cpu"
    assert worker_options(1, 0)["num_gpus"] == 0
    # an explicit device wins; a negative share is refused with a clear error
    pinned = ServeConfig(num_gpus_per_worker=1, engine={"device": "cuda:1"})
    assert pinned.worker_engine(8)["device"] == "cuda:1"
    with pytest.raises(ValueError, match="num_gpus_per_worker"):
        config_from_args(build_parser().parse_args(["serve", "--gpus-per-worker", "-1"]))


def test_lora_flags_reach_the_engine_and_bad_ones_are_one_line():
    from kvserve.cli import build_parser
    from kvserve.deploy.serve_cli import config_from_args
    from kvserve.errors import ConfigError

    cfg = config_from_args(build_parser().parse_args(
        ["serve", "--lora", "sql=/a/sql", "--lora", "chat=org/chat@v2", "--max-loras", "2",
         "--max-lora-rank", "64", "--max-cpu-loras", "6"]))
    engine = cfg.router_config().worker_engine(8)
    assert engine["loras"] == {"sql": "/a/sql", "chat": "org/chat@v2"}
    assert (engine["enable_lora"], engine["max_loras"], engine["max_lora_rank"],
            engine["max_cpu_loras"]) == (True, 2, 64, 6)
    plain = config_from_args(build_parser().parse_args(["serve"]))
    assert not plain.engine_config().lora_enabled
    assert config_from_args(build_parser().parse_args(
        ["serve", "--enable-lora"])).engine_config().lora_enabled
    for argv, why in ((["--lora", "sql"], "NAME=PATH"),
                      (["--lora", "a=/x", "--lora", "a=/y"], "named twice"),
                      (["--lora", "a=/x", "--max-loras", "4", "--max-cpu-loras", "2"],
                       "max_cpu_loras"),
                      (["--lora", "a=/x", "--tensor-parallel-size", "2"], "tensor_parallel_size")):
        with pytest.raises(ConfigError, match=why):
            config_from_args(build_parser().parse_args(["serve", "--gpus-per-worker", "0", *argv]))


def test_a_bad_lora_adapter_is_refused_before_ray_starts(tmp_path):
    from lora_adapters import smollm2_adapter

    from kvserve.deploy.config import ServeConfig
    from kvserve.deploy.serve_cli import _resolve_tokenizer
    from kvserve.errors import AdapterError

    good = smollm2_adapter(str(tmp_path / "good"), 4, seed=1, targets=["q_proj"])
    big = smollm2_adapter(str(tmp_path / "big"), 16, seed=2, targets=["q_proj"])
    _resolve_tokenizer(ServeConfig(loras={"good": good}, max_lora_rank=8))
    with pytest.raises(AdapterError, match="--lora big=.*rank 16 .* above max_lora_rank 8"):
        _resolve_tokenizer(ServeConfig(loras={"good": good, "big": big}, max_lora_rank=8))
    # a path this machine lacks is left to the workers (it may be on their nodes)
    _resolve_tokenizer(ServeConfig(loras={"far": "/on/the/workers/only"}))


def test_several_base_models_each_get_workers_and_a_router():
    from kvserve.cli import build_parser
    from kvserve.deploy.config import ServeConfig
    from kvserve.deploy.serve_cli import _workers, config_from_args

    one = config_from_args(build_parser().parse_args(["serve", "--model", "org/a"]))
    assert one.model == "org/a" and one.models == [] and one.engine_config().model == "org/a"
    assert one.per_model() == [one] and one.router_names() == ["kvserve-router"]
    assert config_from_args(build_parser().parse_args(["serve"])).model is None
    # --model twice: two base models, --workers workers each
    two = config_from_args(build_parser().parse_args(
        ["serve", "--model", "org/a", "--model", "org/b", "--workers", "2"]))
    assert (two.model, [m.model for m in two.models]) == ("org/a", ["org/b"])
    assert two.model_names() == ["org/a", "org/b"] and two.most_workers() == 4
    a, b = two.per_model()
    # the first keeps a single model's names (router, workers); the second has its own
    assert (a.router_name, b.router_name) == ("kvserve-router", "kvserve-model1-router")
    assert (a.model, b.model, a.num_workers, b.num_workers) == ("org/a", "org/b", 2, 2)
    assert b.engine_config().model == "org/b" and b.router_config().model_name == "org/b"
    # their workers share a node's cores as all four would
    assert a.router_config().worker_engine(8)["num_threads"] == 2
    assert b.router_config().worker_engine(8)["num_threads"] == 2
    assert _workers(two) == "4 worker(s) (2 for org/a, 2 for org/b)"
    # a per-model worker count and name (the chart's and a config file's form)
    cfg = ServeConfig(model=["org/a", {"model": "org/c", "workers": 3,
                                       "served_model_name": "cee"}])
    assert [c.num_workers for c in cfg.per_model()] == [1, 3]
    assert cfg.model_names() == ["org/a", "cee"] and cfg.most_workers() == 4
    # a config round trip (the ingress gets the config as a dict) is the same config
    assert ServeConfig(**cfg.model_dump()) == cfg
    assert ServeConfig(model=["org/a"]).model == "org/a"


def test_several_base_models_refuse_what_they_cannot_honour():
    from kvserve.cli import build_parser
    from kvserve.deploy.config import ServeConfig
    from kvserve.deploy.serve_cli import config_from_args
    from kvserve.errors import ConfigError

    two = ["serve", "--model", "org/a", "--model", "org/b"]
    for argv, why in (
            (["--prefill-workers", "1", "--decode-workers", "1"], "prefill_workers and "
                                                                   "decode_workers"),
            (["--min-workers", "1", "--max-workers", "2"], "autoscaling"),
            (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
             "speculative_config"),
            (["--lora", "org/b=/x"], "'org/b' are base model names")):
        with pytest.raises(ConfigError, match=why):
            config_from_args(build_parser().parse_args([*two, *argv]))
    with pytest.raises(ValueError, match="'org/a' served twice"):
        ServeConfig(model=["org/a", "org/a"])
    with pytest.raises(ValueError, match="num_workers"):
        ServeConfig(model=["org/a", {"model": "org/b", "workers": 0}])
    with pytest.raises(ValueError, match="differs from served_model_name"):
        ServeConfig(model=[{"model": "org/a", "served_model_name": "x"}],
                    served_model_name="y")


def test_tensor_parallel_size_reaches_the_engine_and_the_gpus_add_up():
    from kvserve.cli import build_parser
    from kvserve.deploy.serve_cli import config_from_args

    cfg = config_from_args(build_parser().parse_args(
        ["serve", "--tensor-parallel-size", "4", "--gpus-per-worker", "4"]))
    engine = cfg.router_config().worker_engine(8)
    assert engine["tensor_parallel_size"] == 4 and engine["device"] == "cuda"
    cpu = config_from_args(build_parser().parse_args(
        ["serve", "--tensor-parallel-size", "2", "--gpus-per-worker", "0"]))
    # the node's cores for the worker's engine, which shares them among its ranks
    assert cpu.router_config().worker_engine(8)["num_threads"] == 8
    with pytest.raises(ValueError, match="one rank per GPU: num_gpus_per_worker .* must be 4, got 1"):
        ServeConfig(tensor_parallel_size=4, num_gpus_per_worker=1)
    with pytest.raises(ValueError, match="engine.tensor_parallel_size 2 differs"):
        ServeConfig(tensor_parallel_size=4, engine={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="num_cpus_per_worker must be > 0"):
        ServeConfig(tensor_parallel_size=2, num_cpus_per_worker=0)


def test_serve_refuses_a_size_the_model_cannot_split_before_ray_starts(capsys):
    import sys

    from kvserve.cli import main

    ray_was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    # the default model has 9 attention heads
    assert main(["serve", "--tensor-parallel-size", "2", "--gpus-per-worker", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve: error: ") and "\n" not in err
    assert "tensor_parallel_size 2 does not divide the model's 9 attention heads" in err
    assert ray_was_up == ("ray" in sys.modules and sys.modules["ray"].is_initialized())


def test_serve_refuses_a_context_its_kv_pool_cannot_hold_before_ray_starts(capsys):
    import sys

    from kvserve.cli import main

    ray_was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    assert main(["serve", "--max-model-len", "4096", "--kv-cache-tokens", "1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve: error: ") and "\n" not in err
    assert "max_model_len=4096 is more than this engine's device KV pool holds for one " \
           "stream (1024 tokens" in err
    assert "--kv-cache-tokens" in err and "at most 1024" in err
    assert ray_was_up == ("ray" in sys.modules and sys.modules["ray"].is_initialized())


def test_serve_takes_the_host_tier_and_block_settings():
    from kvserve.cli import build_parser
    from kvserve.deploy.serve_cli import config_from_args

    cfg = config_from_args(build_parser().parse_args(
        ["serve", "--host-cache-gib", "0.5", "--block-size", "32",
         "--host-restore-policy", "recompute"]))
    engine = cfg.engine_config()
    assert (engine.host_cache_gib, engine.block_size, engine.host_restore_policy) == (
        0.5, 32, "recompute")
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        build_parser().parse_args(["serve", "--host-restore-policy", "sometimes"])


def test_a_misspelt_routing_policy_fails_with_the_config():
    with pytest.raises(ValueError, match="routing_policy 'afinity' is not one of affinity, "
                                         "least_loaded, round_robin"):
        ServeConfig(routing_policy="afinity")


def test_generate_with_server_refuses_engine_flags(capsys):
    from kvserve.cli import main

    assert main(["generate", "--server", "127.0.0.1:1", "--prompt", "hi",
                 "--kv-cache-tokens", "99", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-tokens, --tensor-parallel-size set the engine of an offline run" in err


def test_app_port_settings_must_match_serves_proxies():
    from ray.serve.config import HTTPOptions, gRPCOptions

    from kvserve.deploy.proxy_options import mismatches

    http, grpc_ = HTTPOptions(host="0.0.0.0", port=8000), gRPCOptions(port=9000)
    assert mismatches(ServeConfig(), http, grpc_) == []  # unset: Serve's own
    tls = ServeConfig(ssl_certfile="/c.pem", ssl_keyfile="/k.pem")
    assert mismatches(tls, http, grpc_) == [
        "ssl_certfile='/c.pem', but Serve's HTTP proxy has None (http_options.ssl_certfile)",
        "ssl_keyfile='/k.pem', but Serve's HTTP proxy has None (http_options.ssl_keyfile)"]
    assert mismatches(ServeConfig(http_port=8000, grpc_port=9000, http_host="0.0.0.0"),
                      http, grpc_) == []
    bad = mismatches(ServeConfig(http_port=8001, grpc_port=9001, http_host="127.0.0.1"),
                     http, grpc_)
    assert bad == ["http_port=8001, but Serve's HTTP proxy listens on port 8000 "
                   "(http_options.port)",
                   "http_host='127.0.0.1', but Serve's HTTP proxy binds '0.0.0.0' "
                   "(http_options.host)",
                   "grpc_port=9001, but Serve's gRPC proxy listens on port 9000 "
                   "(grpc_options.port)"]


@pytest.mark.slow  # a second Serve app: ~20 s
def test_an_app_whose_ports_serve_does_not_use_is_refused(serve_app):
    """Deployed with Serve's own tools onto running proxies, an app whose http_port says
    another port than Serve's HTTP proxy uses fails to start, naming Serve's setting."""
    from ray import serve

    from kvserve.deploy.app import build_app

    cfg = serve_app.config.model_copy(update={"http_port": serve_app.http_port + 1,
                                              "router_name": "kvserve-ports-router"})
    try:
        with pytest.raises(RuntimeError, match="Deploying application ports-mismatch failed"):
            serve.run(build_app(cfg), name="ports-mismatch", route_prefix="/ports-mismatch")
        # what `serve status` (and `serve run`'s log) says of the deployment
        why = serve.status().applications["ports-mismatch"].deployments["KVServeIngress"].message
        assert re.search(r"http_port=\d+, but Serve's HTTP proxy listens on port \d+ "
                         r"\(http_options.port\)", why), why
        assert "set the ports, host and TLS files there" in why
    finally:
        serve.delete("ports-mismatch")


def test_cpu_matmul_flag_reaches_the_workers_engine():
    from kvserve.cli import build_parser
    from kvserve.deploy.serve_cli import config_from_args

    parse = build_parser().parse_args
    int8 = config_from_args(parse(["serve", "--cpu-matmul", "int8"]))
    assert int8.router_config().worker_engine(8)["cpu_matmul"] == "int8"
    plain = config_from_args(parse(["serve"]))
    assert "cpu_matmul" not in plain.engine  # the engine's own default (int8)
    exact = config_from_args(parse(["serve", "--cpu-matmul", "exact"]))
    assert exact.router_config().worker_engine(8)["cpu_matmul"] == "exact"
    with pytest.raises(SystemExit):
        parse(["serve", "--cpu-matmul", "fp8"])


def test_kv_cache_dtype_flag_reaches_the_workers_engine():
    from kvserve.cli import build_parser
    from kvserve.config import EngineConfig
    from kvserve.deploy.serve_cli import config_from_args

    parse = build_parser().parse_args
    half = config_from_args(parse(["serve", "--kv-cache-dtype", "float16"]))
    assert half.router_config().worker_engine(8)["kv_cache_dtype"] == "float16"
    assert "kv_cache_dtype" not in config_from_args(parse(["serve"])).engine  # auto: the model's
    with pytest.raises(SystemExit):
        parse(["serve", "--kv-cache-dtype", "fp8"])
    # auto follows the model's dtype; on CUDA the cache must hold it
    assert EngineConfig(device="cpu").resolved_kv_cache_dtype() == "float32"
    assert EngineConfig(device="cpu", dtype="bfloat16").resolved_kv_cache_dtype() == "bfloat16"
    assert EngineConfig(device="cpu", kv_cache_dtype="float16").resolved_kv_cache_dtype() == "float16"
    assert EngineConfig(device="cuda", dtype="float16",
                        kv_cache_dtype="float16").resolved_kv_cache_dtype() == "float16"
    with pytest.raises(ValueError, match="on CUDA the KV cache holds the model's dtype"):
        EngineConfig(device="cuda", kv_cache_dtype="float16").resolved_kv_cache_dtype()
