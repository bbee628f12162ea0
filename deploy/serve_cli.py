"""`kvserve serve`: start (or join) Ray, deploy the app with gRPC + HTTP, wait for Ctrl-C."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvserve.deploy import tls
from kvserve.deploy.app import APP_NAME, GRPC_SERVICER, build_app
from kvserve.deploy.autoscaling import add_autoscaling_args, autoscaling_from_args
from kvserve.deploy.config import ServeConfig
from kvserve.deploy.placement import PlacementError, check_placement
from kvserve.deploy.ray_start import init_ray
from kvserve.deploy.ray_tuning import apply_cpu_host_defaults
from kvserve.deploy.serve_stop import (
    SIGNALS,
    OwnRay,
    StopSignals,
    become_subreaper,
    end_own_processes,
    free_port,
    stop_service,
)
from kvserve.deploy.startup_states import StartupStates
from kvserve.errors import ConfigError, KVServeError, StartupError


@dataclass
class Endpoints:
    grpc_target: str  # host:port for grpc channels
    http_url: str  # base URL of the OpenAI API (without /v1)


log = logging.getLogger(__name__)
# Ray waits 60 s per try for Serve's proxies; a loaded 2-core machine can need several tries
START_TIMEOUT_ENV = "KVSERVE_START_TIMEOUT_S"
DEFAULT_START_TIMEOUT_S = 600.0
LOOPBACK = "127.0.0.1"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's single-node, loopback mode
# Ray's metrics export port (the one KubeRay uses) and dashboard port, for a Ray kvserve starts
DEFAULT_METRICS_PORT = 8080
DEFAULT_DASHBOARD_PORT = 8265


def local_ray_init(ray_host: str = LOOPBACK) -> dict[str, Any]:
    """ray.init arguments for a Ray that kvserve starts itself: Ray binds its servers (GCS,
    raylet, object manager, workers, agents) to the node address, and the dashboard to its
    own host; both are the loopback interface unless `ray_host` says otherwise."""
    return {"_node_ip_address": ray_host, "dashboard_host": ray_host}


def keep_ray_local(ray_host: str = LOOPBACK) -> bool:
    """Make a Ray started from this process a single-node, loopback-only one.

    On Linux, ray.init turns a loopback `_node_ip_address` into the host's routable address
    (so that other nodes could join) and its servers then listen on every interface. Ray's
    single-node mode (the default on macOS and Windows, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`)
    keeps the node address on loopback, and every Ray server binds there. Ray reads the
    variable when it is imported, and its processes inherit it: call this before `import ray`.
    A value already in the environment wins. Returns whether the mode is on."""
    if ray_host not in (LOOPBACK, "localhost", "::1"):
        return False
    os.environ.setdefault(LOCAL_ONLY_ENV, "0")
    return os.environ[LOCAL_ONLY_ENV] == "0"


def deploy(
    cfg: ServeConfig, ray_init: dict[str, Any] | None = None, start_timeout_s: float | None = None,
    ray_host: str = LOOPBACK,
) -> Endpoints:
    """Start a local Ray if none is running, start Serve on the configured ports, deploy.

    A Ray started here listens on `ray_host` only (loopback by default); `ray_init` entries
    win over that. A Ray that is already running keeps its own settings. Workers that the
    nodes can never hold fail first (PlacementError, deploy/placement.py)."""
    own = start_ray(cfg, ray_init, ray_host)
    check_placement(cfg, own_ray=own)
    return deploy_app(cfg, start_timeout_s)


def start_ray(cfg: ServeConfig, ray_init: dict[str, Any] | None = None,
              ray_host: str = LOOPBACK) -> bool:
    """Connect to the running Ray (this process's, $RAY_ADDRESS or one `ray start` began on
    this machine), or start a local one. Returns whether it started one (a local Ray, which
    cannot add nodes)."""
    if not _ray_running():
        keep_ray_local(ray_host)
    import ray

    if ray.is_initialized():
        return False
    own = not _joining() and (ray_init or {}).get("address") in (None, "local")
    if cfg.num_gpus_per_worker == 0:
        apply_cpu_host_defaults()
    init_ray({**local_ray_init(ray_host), **(ray_init or {})})
    return own


def deploy_app(cfg: ServeConfig, start_timeout_s: float | None = None) -> Endpoints:
    """Start Serve on the configured ports and deploy the app (Ray is running)."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    cfg = cfg.with_proxy_defaults()

    if start_timeout_s is None:
        start_timeout_s = float(os.environ.get(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S))
    deadline = time.monotonic() + start_timeout_s
    tls.check(cfg)
    env = tls.proxy_env(cfg)  # the proxies get it from the controller (deploy/proxy_tls.py)
    _until_ready(lambda: serve.start(
        http_options=HTTPOptions(host=cfg.http_host, port=cfg.http_port, **tls.http_options(cfg)),
        grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]),
        controller_options={"runtime_env": {"env_vars": env}} if env else None,
    ), f"Serve's proxies (HTTP {cfg.http_host}:{cfg.http_port}, gRPC :{cfg.grpc_port})", deadline)
    tls.check_running_serve(cfg)
    _until_ready(lambda: serve.run(build_app(cfg), name=APP_NAME, route_prefix="/"),
                 f"the {APP_NAME} application (router, {_workers(cfg)} loading the "
                 "model, ingress) and the proxies serving it", deadline)
    host = "127.0.0.1" if cfg.http_host in ("0.0.0.0", "::") else cfg.http_host
    scheme = "https" if cfg.tls else "http"
    return Endpoints(f"{host}:{cfg.grpc_port}", f"{scheme}://{host}:{cfg.http_port}")


def _ray_running() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _until_ready(step: Callable[[], Any], what: str, deadline: float) -> None:
    """Run a Serve start-up step, trying again while it times out and time is left.

    Both steps are idempotent: a second serve.start connects to the controller the first one
    made, and a second serve.run of an unchanged app only waits for it again. On a machine
    too loaded for a proxy to answer its first health checks, the controller kills the proxy
    and serve.start fails with the actor's death; the controller starts a new one, so that
    counts as a timeout too."""
    from ray.exceptions import RayActorError

    tries = 0
    while True:
        tries += 1
        try:
            step()
            return
        except (TimeoutError, RayActorError) as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"kvserve: gave up waiting for {what} after {tries} tries ({e}); the machine "
                    f"may be overloaded: raise ${START_TIMEOUT_ENV} (seconds) to wait longer"
                ) from e
            log.warning("still waiting for %s (%s); %.0f s left", what, e, left)


def stop_app(name: str = APP_NAME, wait_s: float = 600.0) -> bool:
    """Delete a Serve app gracefully: its replicas stop taking requests and serve those in
    flight for up to the app's `shutdown_grace_s` (see deploy/shutdown.py) before they go.
    Returns whether it was gone within `wait_s` (serve.delete's own wait stops at 60 s)."""
    from ray import serve

    serve.delete(name, _blocking=False)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        st = serve.status().applications.get(name)
        if st is None or st.status == "NOT_STARTED":
            return True
        time.sleep(0.5)
    return False


def shutdown(cfg: ServeConfig | None = None) -> None:
    """Stop the app (requests in flight get `shutdown_grace_s`), Serve, the router, Ray."""
    import ray
    from ray import serve

    from kvserve.router.lifecycle import kill_router

    cfg = cfg or ServeConfig()
    try:
        try:
            if not stop_app(APP_NAME, cfg.shutdown_grace_s + 60.0):
                log.warning("kvserve: the app did not stop within its grace period; stopping it")
        except Exception as e:  # no app (it never deployed) or Serve already gone
            log.warning("kvserve: deleting the app failed (%s); stopping Serve", e)
        serve.shutdown()
        if ray.is_initialized():
            # detached: it would outlive Serve (and keep its workers' memory)
            for name in cfg.router_names():
                kill_router(name)
    finally:
        if ray.is_initialized():
            ray.shutdown()


def serve_forever(cfg: ServeConfig, ray_host: str = LOOPBACK,
                  metrics_port: int = DEFAULT_METRICS_PORT,
                  dashboard_port: int = DEFAULT_DASHBOARD_PORT) -> int:
    """`kvserve serve`: start, print where everything is, serve until SIGTERM / SIGINT, stop
    (see deploy/serve_stop.py). Returns 0 when stopped by a signal, whenever it came."""
    cfg = cfg.with_proxy_defaults()
    ports = [cfg.http_port, cfg.grpc_port]

    def stuck() -> None:  # a signal the main thread, stuck in Ray's start, cannot take
        end_own_processes(ports, time.monotonic() + 5.0)
        print("kvserve: stopped", flush=True)
        _exit_now(0)

    # First, before the process-wide state below (stop handlers, subreaper): unusable
    # certificate files, then a model name that does not resolve, are the first errors to
    # hear about, and leave nothing installed.
    tls.check(cfg)
    try:
        with _interrupted_by_signals():
            _resolve_tokenizer(cfg)
    except KeyboardInterrupt:  # stopped while the tokenizer downloads: nothing else started
        print("kvserve: stopped", flush=True)
        _exit_now(0)  # (not waiting for the download's threads)
    signals = StopSignals(stuck)  # before anything starts: nothing may come up unstoppable
    become_subreaper()
    keep_ray_local(ray_host)  # before Ray is imported (it reads the setting then)
    joining = _joining()
    if not joining:
        _check_free({"--metrics-port": metrics_port, "--dashboard-port": dashboard_port})
    print(f"kvserve: starting {'(joining the running Ray)' if joining else 'Ray'} ...",
          flush=True)
    ray_init = {} if joining else {"include_dashboard": True, "dashboard_port": dashboard_port
                                   or free_port(), "_metrics_export_port": metrics_port or None}
    shown: StartupStates | None = None
    try:
        with signals.interrupting():
            with signals.kept():
                own = start_ray(cfg, ray_init, ray_host)
            check_placement(cfg, own_ray=own)  # before any model loads
            print(f"kvserve: deploying {', '.join(cfg.model_names())} on {_workers(cfg)} "
                  "(the model loads) ...", flush=True)
            ep, shown = _deploy_showing_states(cfg)
            _print_banner(cfg, ep, shown.not_ready())
            shown.keep_showing()  # the workers still waiting: their progress, then ready
    except KeyboardInterrupt:  # a signal during the start: stop what started
        pass
    except PlacementError as e:  # nothing deployed yet: only Ray to stop (or leave)
        print(f"kvserve: error: {e}", flush=True)
        _stop_ray(ports)
        _exit_now(2)
    except KVServeError as e:  # a worker that failed to start says why, in one line
        print(f"kvserve: {e}; stopping what started", flush=True)
        _stop(cfg, signals)
        _exit_now(1)
    except BaseException:
        print("kvserve: the start failed; stopping what started", flush=True)
        traceback.print_exc()
        _stop(cfg, signals)
        _exit_now(1)
    signals.stop.wait()  # a signal's handler sets it (the wait wakes for the handler)
    if shown is not None:
        shown.stop()
    name = signal.Signals(signals.signum).name if signals.signum else "a signal"
    print(f"kvserve: {name}: shutting down (requests in flight get {cfg.shutdown_grace_s:g} s)",
          flush=True)
    _stop(cfg, signals)
    print("kvserve: stopped", flush=True)
    _exit_now(0)
    return 0


@contextlib.contextmanager
def _interrupted_by_signals() -> Iterator[None]:
    """SIGTERM, like SIGINT, raises KeyboardInterrupt inside the block; the handlers from
    before come back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (signal handlers can only be set from the main thread)
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    before = {s: signal.signal(s, interrupt) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _resolve_tokenizer(cfg: ServeConfig) -> None:
    """A Hub name the Hub does not know (or gated, or unreachable), or a tensor-parallel size
    its model cannot take, fails here in one line; the ingress then finds the tokenizer in the
    cache, the workers fetch the weights."""
    from kvserve.models import resolve_model
    from kvserve.workers.loading.loader import read_model_config
    from kvserve.workers.loading.sharding import check_tensor_parallel
    from kvserve.workers.model.runner import context_limit

    if cfg.models:  # each base model on its own
        for c in cfg.per_model():
            _resolve_tokenizer(c)
        return
    path = resolve_model(cfg.model, tokenizer_only=True)
    try:
        model_config = read_model_config(path)
    except Exception:  # (a partial download, say): the workers load it and report
        return
    # a size the model cannot split, or a max_model_len the KV pool cannot hold: refused
    # before Ray starts
    sizes = {cfg.role_tensor_parallel_size(r) for r in ("prefill", "decode")} \
        if cfg.disaggregated else {cfg.tensor_parallel_size}
    for tp in sorted(sizes):  # (each role's, with prefill and decode workers)
        if tp > 1:
            check_tensor_parallel(model_config, tp, cfg.model or path)
    context_limit(model_config, cfg.engine_config())
    _check_adapters(cfg, model_config)


def _check_adapters(cfg: ServeConfig, model_config: Any) -> None:
    """A bad --lora adapter in a directory this machine has (another base model's, a rank
    above --max-lora-rank, corrupt files) fails here in one line, before Ray starts; one
    only the workers' nodes have, or a Hub id, the workers check as they start."""
    from kvserve.errors import AdapterError
    from kvserve.workers.loading.lora import load_adapter

    for name, source in cfg.loras.items():
        local = os.path.expanduser(source)
        if not os.path.isdir(local):
            continue
        try:
            load_adapter(local, model_config, cfg.max_lora_rank)
        except AdapterError as e:
            raise AdapterError(f"--lora {name}={source}: {e}") from None


def _deploy_showing_states(cfg: ServeConfig) -> tuple[Endpoints, StartupStates]:
    """deploy_app, printing each worker's start-up state as it changes. Returns the states
    as the app came up (it may serve while workers still wait for resources)."""
    shown = StartupStates(cfg.router_name if not cfg.models else
                          [(c.model_name(), c.router_name) for c in cfg.per_model()])
    shown.start()
    try:
        ep = deploy_app(cfg)
    except RuntimeError:  # Serve's "deploying failed" says less than the worker that failed
        failed = shown.failed()
        if not failed:
            raise
        raise StartupError(f"the app did not start: {failed}") from None
    finally:
        shown.stop()
    with contextlib.suppress(Exception):
        shown.poll(quiet=True)  # as the app came up (the last poll may be 2 s old)
    return ep, shown


def _stop(cfg: ServeConfig, signals: StopSignals) -> None:
    import ray

    joined = ray.is_initialized() and not OwnRay().core

    def graceful() -> None:
        stop_app(APP_NAME, cfg.shutdown_grace_s + 60.0)
        if joined:  # a Ray of its own goes as a whole; in a joined one, Serve and the router
            shutdown(cfg)

    stop_service(graceful, cfg.shutdown_grace_s, signals, [cfg.http_port, cfg.grpc_port])


def _stop_ray(ports: list[int]) -> None:
    """Stop the Ray this command started, before anything was deployed on it (Ray's own
    shutdown: its processes end without a word to the console), or leave a joined one."""
    import ray

    t = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    t.start()
    t.join(30.0)
    end_own_processes(ports, time.monotonic() + 10.0)


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown. Everything is stopped by now; what is left
    is freeing the heap (torch, Ray: seconds on a loaded machine), and Ray's exit handlers,
    which wait on a call stuck if the Ray processes went with the same signal (a GCS that
    is gone is waited for 60 s)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _print_banner(cfg: ServeConfig, ep: Endpoints, not_ready: dict[str, str]) -> None:
    """Where everything is; the workers not serving yet (waiting for resources) with their
    states."""
    from kvserve.deploy.ray_endpoints import ray_endpoints, token_hint

    ray_ep = ray_endpoints()
    contexts = [_served_context(name) for name in cfg.router_names()]
    n = sum(c.total_workers for c in cfg.per_model())
    serving = f"{n - len(not_ready)} of {_workers(cfg)}" if not_ready else _workers(cfg)
    a = cfg.autoscaling
    scaling = (f", autoscaling {a.min_workers}..{a.max_workers} (delays: up "
               f"{a.upscale_delay_s:g} s, down {a.downscale_delay_s:g} s)" if a else "")
    print(f"kvserve: serving {', '.join(cfg.model_names())} on {serving}{scaling}"
          + _contexts_note(cfg.model_names(), contexts))
    for worker, state in not_ready.items():
        print(f"  {worker:<10} {state}")
    client_tls = ""
    if cfg.tls:  # (--ca too where a private CA signed the server's certificate)
        client_tls = " --tls --cert CERT.pem --key KEY.pem" if cfg.ssl_ca_certs else " --tls"
    print(f"  gRPC       {ep.grpc_target}   ({_tls_note(cfg)}kvserve generate --server "
          f"{ep.grpc_target}{client_tls} --prompt ...)")
    print(f"  HTTP       {ep.http_url}/v1   ({_tls_note(cfg)}OpenAI API: /v1/completions, "
          "/v1/chat/completions)")
    if cfg.loras or cfg.enable_lora:
        names = ", ".join(cfg.loras) or "none yet"
        print(f"  LoRA       {names}   (as `model`; {cfg.max_loras} device slots per worker; "
              "POST /v1/load_lora_adapter to add)")
    print(f"  metrics    {ray_ep.metrics_url}   (Prometheus; kvserve's series are ray_kvserve_*)")
    if ray_ep.dashboard_url:
        auth = f"   ({token_hint()})" if ray_ep.token_auth else ""
        print(f"  dashboard  {ray_ep.dashboard_url}{auth}")
    warning = tls.exposure_warning(cfg)
    if warning:
        print(f"  WARNING    {warning}")
    print("Ctrl-C to stop", flush=True)


def _workers(cfg: ServeConfig) -> str:
    """"2 worker(s)", or "1 prefill + 2 decode worker(s)"."""
    if cfg.disaggregated:
        return f"{cfg.prefill_workers} prefill + {cfg.decode_workers} decode worker(s)"
    if cfg.models:  # "3 worker(s) (2 for a, 1 for b)"
        each = [(c.num_workers, c.model_name()) for c in cfg.per_model()]
        return (f"{sum(n for n, _ in each)} worker(s) ("
                + ", ".join(f"{n} for {m}" for n, m in each) + ")")
    return f"{cfg.num_workers} worker(s)"


def _contexts_note(names: list[str], contexts: list[int | None]) -> str:
    """The banner's context: one model's, or each model's (those known)."""
    if len(contexts) == 1:
        return f", context {contexts[0]} tokens (prompt + max_tokens)" if contexts[0] else ""
    known = [f"{n} {c}" for n, c in zip(names, contexts, strict=True) if c]
    return f", context {', '.join(known)} tokens (prompt + max_tokens)" if known else ""


def _served_context(router_name: str) -> int | None:
    """The context a model's workers serve (the model's, or less where the KV pool holds
    less), from its router."""
    import ray

    from kvserve.router.lifecycle import find_router

    try:
        router = find_router(router_name)
        info = ray.get(router.server_info.remote(), timeout=10) if router is not None else {}
        return int(info["model_info"]["max_model_len"])
    except Exception:  # (the banner goes without it)
        return None


def _tls_note(cfg: ServeConfig) -> str:
    if not cfg.tls:
        return ""
    return "TLS, client certificates required; " if cfg.ssl_ca_certs else "TLS; "


def _joining() -> bool:
    """Whether start_ray will connect to a running Ray instead of starting one."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:
        return False
    try:
        return canonicalize_bootstrap_address(None) is not None
    except Exception:  # an address that does not parse: ray.init says so
        return True


def _check_free(ports: dict[str, int]) -> None:
    from kvserve.deploy.serve_stop import port_in_use

    for flag, port in ports.items():
        if port and port_in_use(port):
            raise SystemExit(f"kvserve: port {port} ({flag}) is in use; pick another with "
                             f"{flag} (0: any free port)")


def add_serve_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve the model on Ray: gRPC + OpenAI HTTP API")
    from kvserve.models import MODEL_HELP

    # appended: each --model is one more base model (ServeConfig splits the list)
    s.add_argument("--model", action="append", default=None,
                   help=f"{MODEL_HELP}; repeat it to serve several base models, each with "
                        "its own --workers workers, requests routed by `model` (the first "
                        "is the default)")
    s.add_argument("--workers", type=int, default=None,
                   help="worker actors per base model (one engine each; default 1, or none with "
                        "--prefill-workers and --decode-workers); with autoscaling, the "
                        "workers it starts with (default: max(1, --min-workers))")
    s.add_argument("--gpus-per-worker", type=float, default=None,
                   help="GPUs per worker actor; a fraction (0.5) lets workers share a GPU; "
                        "default: the tensor-parallel size if CUDA else 0")
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices each worker spans, one rank per device on one node (the "
                        "model's heads, MLP and vocabulary split across them)")
    s.add_argument("--cpus-per-worker", type=float, default=1,
                   help="Ray CPUs each worker reserves on its node (a fraction lets more "
                        "workers share a node's CPUs)")
    s.add_argument("--wait-for-all-workers", action="store_true",
                   help="serve only once every worker is ready; by default it serves once one "
                        "is while others wait for resources (a node the autoscaler adds)")
    s.add_argument("--placement-timeout-s", type=float, default=900.0,
                   help="a worker that Ray has not placed on a node this long after its start "
                        "is stopped and reported failed, with what it waited for (default 900)")
    d = s.add_argument_group("disaggregated serving (prefill on one worker, decode on another)")
    d.add_argument("--prefill-workers", type=int, default=0,
                   help="workers that run prompts, send the first token and hand the streams "
                        "to decode workers")
    d.add_argument("--decode-workers", type=int, default=0,
                   help="workers that decode the streams handed to them (and prefill short "
                        "prompts themselves)")
    d.add_argument("--prefill-gpus-per-worker", type=float, default=None,
                   help="a prefill worker's GPUs (default: --gpus-per-worker, or its "
                        "tensor-parallel size on a CUDA host)")
    d.add_argument("--decode-gpus-per-worker", type=float, default=None,
                   help="a decode worker's GPUs (default as for prefill workers)")
    d.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                   help="a prefill worker's tensor-parallel size (default "
                        "--tensor-parallel-size)")
    d.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                   help="a decode worker's tensor-parallel size (default "
                        "--tensor-parallel-size)")
    d.add_argument("--disagg-min-prompt-tokens", type=int, default=None,
                   help="prompts shorter than this are prefilled on their decode worker "
                        "(default 16, measured: docs/benchmarks.md)")
    d.add_argument("--disagg-failure-policy", choices=["recompute", "fail"], default="recompute",
                   help="a hand-off that fails: recompute the stream on a decode worker "
                        "(default), or fail the request")
    s.add_argument("--stream-interval-ms", type=float, default=None,
                   help="least time between a stream's chunks (0 = every engine step); "
                        "default: automatic on CPU workers, every step on GPU")
    s.add_argument("--grpc-port", type=int, default=9000)
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    s.add_argument("--ray-host", default=LOOPBACK,
                   help="address the Ray that kvserve starts binds to (its GCS, raylet, workers, "
                        "dashboard); default loopback only. Ignored when joining a running Ray")
    s.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help="Ray's Prometheus metrics port (0 = any free port); the banner and "
                        "GetServerInfo name it. Ignored when joining a running Ray")
    s.add_argument("--dashboard-port", type=int, default=DEFAULT_DASHBOARD_PORT,
                   help="the Ray dashboard's port (0 = any free port). Ignored when joining a "
                        "running Ray")
    s.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body / gRPC message accepted (HTTP 413 beyond)")
    s.add_argument("--api-key", action="append", default=[],
                   help="accepted API key (repeatable; also $KVSERVE_API_KEYS)")
    t = s.add_argument_group("TLS (both APIs: HTTPS, and TLS on gRPC)")
    t.add_argument("--ssl-certfile", default=None, metavar="PEM",
                   help="server certificate (chain); with --ssl-keyfile")
    t.add_argument("--ssl-keyfile", default=None, metavar="PEM",
                   help="its private key (without a passphrase)")
    t.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                   help="CA certificate(s): clients must present a certificate one of them "
                        "signed (mutual TLS)")
    s.add_argument("--routing-policy", default="affinity",
                   choices=["affinity", "least_loaded", "round_robin"])
    s.add_argument("--max-inflight-per-worker", type=int, default=256)
    s.add_argument("--shutdown-grace-s", type=float, default=120.0,
                   help="on SIGTERM / Ctrl-C, requests in flight get this long to finish "
                        "(then UNAVAILABLE / 503)")
    add_autoscaling_args(s)
    e = s.add_argument_group("engine")
    e.add_argument("--kv-cache-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output; default: the model's context, or less where "
                        "the KV pool holds less for one stream (a larger value is refused)")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV block (16)")
    e.add_argument("--host-cache-gib", type=float, default=None,
                   help="host-memory KV tier per worker (0 = off; default: 20%% of the RAM "
                        "available, at most 4 GiB; set it when several workers share a machine)")
    e.add_argument("--host-restore-policy", choices=["cost", "copy", "recompute"], default=None,
                   help="how a parked stream's KV comes back: by copy or recomputed, whichever "
                        "the measured costs say is cheaper (cost, the default), or always one way")
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per worker (default on CPU: cores / workers)")
    e.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=None,
                   help="weights and KV (default auto: bfloat16 on GPU workers, float32 on CPU)")
    e.add_argument("--kv-cache-dtype", choices=["auto", "float32", "float16", "bfloat16"],
                   default=None, help="the KV cache's dtype (default auto: the model's); float16 "
                                      "on CPU workers halves the bytes decode attention reads")
    e.add_argument("--cpu-matmul", choices=["int8", "exact"], default=None,
                   help="CPU workers on GGUF blocks: 8-bit activations with integer dot products "
                        "(int8, llama.cpp's scheme; the default) or float32 ones (exact)")
    e.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, vLLM's names: "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (also "
                        "prompt_lookup_min/max), or method draft_model with \"model\" (a draft "
                        "sharing the tokenizer); disable_by_batch_size turns it off for steps "
                        "with that many running streams")
    lo = s.add_argument_group("LoRA adapters")
    lo.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                    help="a PEFT LoRA adapter (directory or Hub id) served as model NAME "
                         "(repeatable); turns LoRA on")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters loaded at run time (POST /v1/load_lora_adapter)")
    lo.add_argument("--max-loras", type=int, default=4,
                    help="adapters in device slots per worker (a step mixes at most this many)")
    lo.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank accepted")
    lo.add_argument("--max-cpu-loras", type=int, default=None,
                    help="adapters kept in host memory per worker (default 4 x --max-loras)")
    s.set_defaults(func=cmd_serve)


def cmd_serve(a: Any) -> int:
    return serve_forever(config_from_args(a), ray_host=a.ray_host, metrics_port=a.metrics_port,
                         dashboard_port=a.dashboard_port)


def config_from_args(a: Any) -> ServeConfig:
    """The ServeConfig of `kvserve serve`'s arguments."""
    engine = {k: v for k, v in {
        "kv_cache_tokens": a.kv_cache_tokens, "max_model_len": a.max_model_len,
        "max_num_seqs": a.max_num_seqs, "num_threads": a.threads,
        "dtype": a.dtype, "kv_cache_dtype": a.kv_cache_dtype, "cpu_matmul": a.cpu_matmul,
        "block_size": a.block_size,
        "host_cache_gib": a.host_cache_gib, "host_restore_policy": a.host_restore_policy}.items() if v is not None}
    gpus = a.gpus_per_worker
    role_gpus = {"prefill": a.prefill_gpus_per_worker, "decode": a.decode_gpus_per_worker}
    if gpus is None:
        import torch

        cuda = torch.cuda.is_available()
        gpus = a.tensor_parallel_size if cuda else 0
        for role, tp in (("prefill", a.prefill_tensor_parallel_size),
                         ("decode", a.decode_tensor_parallel_size)):
            if role_gpus[role] is None and tp is not None:  # one GPU per rank
                role_gpus[role] = tp if cuda else 0
    from pydantic import ValidationError

    try:
        autoscaling = autoscaling_from_args(a)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return _serve_config(a, engine, gpus, role_gpus, autoscaling)
    except ValidationError as e:  # one line, as the other start-up errors
        raise ConfigError("; ".join(_error_line(err) for err in e.errors())) from None
    except ValueError as e:  # --speculative-config's JSON
        raise ConfigError(str(e)) from None


def _error_line(err: Any) -> str:
    msg = str(err["msg"]).removeprefix("Value error, ")
    field = ".".join(str(x) for x in err["loc"])
    return f"{field}: {msg}" if field else msg


def _serve_config(a: Any, engine: dict[str, Any], gpus: float,
                  role_gpus: dict[str, float | None],
                  autoscaling: dict[str, Any] | None) -> ServeConfig:
    roles: dict[str, Any] = {}
    if a.prefill_workers or a.decode_workers:
        roles = {"prefill_workers": a.prefill_workers, "decode_workers": a.decode_workers,
                 "prefill_gpus_per_worker": role_gpus["prefill"],
                 "decode_gpus_per_worker": role_gpus["decode"],
                 "prefill_tensor_parallel_size": a.prefill_tensor_parallel_size,
                 "decode_tensor_parallel_size": a.decode_tensor_parallel_size,
                 "disagg_failure_policy": a.disagg_failure_policy}
        if a.disagg_min_prompt_tokens is not None:
            roles["disagg_min_prompt_tokens"] = a.disagg_min_prompt_tokens
    else:
        for flag in ("prefill_gpus_per_worker", "decode_gpus_per_worker",
                     "prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            if getattr(a, flag) is not None:
                roles[flag] = getattr(a, flag)  # refused by the config, naming it
        if a.disagg_min_prompt_tokens is not None or a.disagg_failure_policy != "recompute":
            raise ConfigError("--disagg-min-prompt-tokens and --disagg-failure-policy need "
                              "--prefill-workers and --decode-workers")
    # an unset --workers stays unset: with autoscaling the pool starts at its minimum, with
    # prefill and decode workers there are no mixed ones
    if a.workers is not None:
        roles["num_workers"] = a.workers
    if autoscaling is not None:
        roles["autoscaling"] = autoscaling  # (refused with prefill and decode workers)
    return ServeConfig(
        **roles, num_gpus_per_worker=gpus, model=a.model,
        tensor_parallel_size=a.tensor_parallel_size,
        num_cpus_per_worker=a.cpus_per_worker, engine=engine, grpc_port=a.grpc_port,
        http_port=a.http_port, http_host=a.host, api_keys=a.api_key,
        routing_policy=a.routing_policy, max_inflight_per_worker=a.max_inflight_per_worker,
        stream_interval_ms=a.stream_interval_ms, max_request_bytes=a.max_request_bytes,
        shutdown_grace_s=a.shutdown_grace_s, ssl_certfile=a.ssl_certfile,
        ssl_keyfile=a.ssl_keyfile, ssl_ca_certs=a.ssl_ca_certs,
        loras=list(a.lora), enable_lora=a.enable_lora, max_loras=a.max_loras,
        max_lora_rank=a.max_lora_rank, max_cpu_loras=a.max_cpu_loras,
        wait_for_all_workers=a.wait_for_all_workers, placement_timeout_s=a.placement_timeout_s,
        speculative_config=a.speculative_config,
    )
