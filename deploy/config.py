"""ServeConfig: every setting of the served application in one pydantic model."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kvserve.config import EngineConfig
from kvserve.deploy.autoscaling import AutoscalingSettings
from kvserve.router.config import RouterConfig
from kvserve.speculative import SpeculativeConfig, parse_speculative_config

API_KEYS_ENV = "KVSERVE_API_KEYS"
# prompts shorter than this are prefilled where they decode (disaggregated serving): one KV
# block. On the CPU host a hand-off (13-30 ms up to 512 tokens) stalls the decode worker's
# streams less than a local prefill of more than a few tokens (about 8 ms a token);
# docs/benchmarks.md, "Disaggregated serving"
DEFAULT_DISAGG_MIN_PROMPT_TOKENS = 16
# where `kvserve serve` starts Serve's proxies unless told otherwise
DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_HTTP_HOST = 9000, 8000, "127.0.0.1"


def model_router_name(router_name: str, n: int) -> str:
    """The router of the n-th further base model (n >= 1) of the app whose first model's
    router is `router_name`."""
    return f"{router_name.removesuffix('-router')}-model{n}-router"


class ModelEntry(BaseModel):
    """A further base model served beside `model`, with its own workers and router."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(min_length=1, description="as ServeConfig.model")
    served_model_name: str | None = Field(None, description="as ServeConfig.served_model_name")
    num_workers: int | None = Field(
        None, ge=1, description="its mixed workers; None = ServeConfig.num_workers")

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        # the chart's and the CLI's short form: just the model; `workers` as in the chart
        if isinstance(data, str):
            return {"model": data}
        if isinstance(data, dict) and "workers" in data:
            data = {k: v for k, v in data.items() if k != "workers"} | \
                {"num_workers": data["workers"]}
        return data

    def name(self) -> str:
        from kvserve.models import served_name

        return self.served_model_name or served_name(self.model)


class ServeConfig(BaseModel):
    """Model, workers, engine and KV sizes, ports, API keys and overload limits."""

    # defaults validated too (0 -> 0.0 for a float), so a config digests the same after a
    # model_dump round trip (the ingress receives it that way)
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), validate_default=True)

    model: str | None = Field(
        None, description="GGUF file, HF directory, or Hub name (org/name[@rev], "
                          "org/name:file.gguf[@rev]); None = default model",
    )
    models: list[ModelEntry] = Field(
        default_factory=list,
        description="further base models served beside `model`, each with its own workers "
                    "(num_workers unless the entry sets its own) and router; requests name "
                    "one in `model`. A list given as `model` (--model more than once) is "
                    "split into `model` (the first) and these",
    )
    served_model_name: str | None = Field(
        None, description="name clients pass as `model`; default = the model file's stem, or "
                          "the Hub repository id",
    )
    num_workers: int = Field(
        1, ge=0, description="mixed worker actors, one engine each (0 with prefill_workers "
                             "and decode_workers, the default then); with autoscaling, the "
                             "workers it starts with (default: max(1, min_workers))")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="the worker pool follows the load between min_workers and "
                          "max_workers (None: a fixed pool of num_workers); mixed workers "
                          "only, not with prefill_workers and decode_workers")
    num_gpus_per_worker: float = Field(
        0, ge=0, description="0 on CPU; a tensor-parallel worker's GPUs: one per rank")
    num_cpus_per_worker: float = Field(1, ge=0, description="Ray CPUs reserved per worker")
    tensor_parallel_size: int = Field(
        1, ge=1, description="devices each worker spans (one rank per device, on one node)")
    wait_for_all_workers: bool = Field(
        False, description="serve only once every worker is ready; by default the service "
                           "serves once one is, while workers wait for resources (a node the "
                           "autoscaler adds)")
    placement_timeout_s: float = Field(
        900.0, gt=0, description="a worker that Ray has not placed this long after its start "
                                 "(no node with its resources free) is stopped and reported "
                                 "failed, with what it waited for")
    speculative_config: SpeculativeConfig | None = Field(
        None, description="speculative decoding of every worker's engine, with vLLM's names "
                          "(method ngram|draft_model, num_speculative_tokens, "
                          "prompt_lookup_min/max, model, disable_by_batch_size); a dict or its "
                          "JSON text; None = off")
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="EngineConfig overrides (kv_cache_tokens, num_threads...); on CPU, "
                    "num_threads defaults to the node's cores divided by num_workers",
    )
    # Serve's proxies own these: `kvserve serve` starts them so (None: 9000, 8000, 127.0.0.1);
    # under `serve run` / `serve deploy` the config file's grpc_options / http_options do, and
    # a value here that differs is refused at start (deploy/proxy_options.py)
    grpc_port: int | None = Field(None, ge=0, le=65535, description="gRPC proxy port")
    http_port: int | None = Field(None, ge=0, le=65535, description="HTTP proxy port")
    http_host: str | None = Field(None, description="HTTP proxy bind address")
    api_keys: list[str] = Field(
        default_factory=list, description=f"accepted API keys; empty = no auth (also ${API_KEYS_ENV})"
    )
    ssl_certfile: str | None = Field(
        None, description="PEM certificate (chain) of both APIs: HTTPS, and TLS on gRPC; with "
                          "ssl_keyfile. Relative paths are made absolute")
    ssl_keyfile: str | None = Field(
        None, description="PEM private key of ssl_certfile (without a passphrase)")
    ssl_ca_certs: str | None = Field(
        None, description="PEM CA certificate(s): clients of both APIs must present a "
                          "certificate one of them signed (mutual TLS); needs ssl_certfile")
    routing_policy: str = Field("affinity", description="affinity, least_loaded or round_robin")
    max_imbalance: int = Field(
        4, ge=0, description="affinity gives way when its worker has this many more in flight"
    )
    max_inflight_per_worker: int = Field(
        256, ge=1, description="requests in flight per worker before new ones are shed (429)"
    )
    load_poll_interval_s: float = Field(1.0, gt=0, description="router's worker poll period")
    slot_grace_s: float = Field(
        60.0, gt=0, description="router: an in-flight slot its worker has not known for this "
                                "long is dropped as stale (a lost release), and logged",
    )
    max_request_bytes: int = Field(
        4 * 1024 * 1024, ge=1024,
        description="largest request body (HTTP 413) or gRPC request message "
                    "(RESOURCE_EXHAUSTED) accepted",
    )
    unavailable_wait_s: float = Field(
        60.0, ge=0, description="a request without a token yet waits this long for a restarting "
                                "router or worker before UNAVAILABLE (503)",
    )
    max_retries: int = Field(2, ge=0, description="retries on another worker before a first token")
    shutdown_grace_s: float = Field(
        120.0, gt=0,
        description="when the app stops or a redeploy replaces the ingress, requests in flight "
                    "get this long to finish; past it they end with UNAVAILABLE (503)",
    )
    router_name: str = Field(
        "kvserve-router", min_length=1,
        description="the detached router actor's name (one router per name on a Ray cluster)",
    )
    stream_interval_ms: float | None = Field(
        None, ge=0,
        description="least time between two chunks of a stream (first and last go at once); "
                    "0 = every engine step; None = every step on GPU workers, and on CPU "
                    "workers 25 chunks/s per worker shared by its streams (at most 250 ms apart)",
    )

    loras: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters loaded at start, name -> PEFT adapter directory or Hub id "
                    "(org/name[@rev]); also a list of 'NAME=PATH' or {name, path}. Requests "
                    "name one in `model`",
    )
    enable_lora: bool = Field(
        False, description="serve LoRA adapters (on when `loras` names any): adapters can be "
                           "loaded at run time (POST /v1/load_lora_adapter, LoadLoraAdapter)")
    max_loras: int = Field(4, ge=1, le=256,
                           description="LoRA adapters in device slots per worker (one step "
                                       "mixes at most this many)")
    max_lora_rank: int = Field(16, ge=1, le=1024, description="the largest LoRA rank accepted")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA adapters kept in host memory per worker (least recently "
                                "used dropped beyond it); None = 4 x max_loras")

    migration: bool = Field(
        True, description="the router moves streams by itself: parked ones to workers with "
                          "room, running ones off pressured workers (migration_rebalance)"
    )
    migration_park_threshold_s: float = Field(
        1.0, ge=0, description="a stream moves once it has been parked this long"
    )
    migration_max_inflight: int = Field(4, ge=1, description="stream moves under way at most")
    migration_min_interval_s: float = Field(
        5.0, ge=0, description="a stream moves at most once per this many seconds"
    )
    migration_headroom: float = Field(
        0.1, ge=0, le=1, description="share of the target's device KV left free after a move"
    )
    migration_live: bool = Field(
        True, description="running streams move live (their KV pre-copied while they decode, "
                          "then a short final stage); off: every move is stop-and-copy")
    migration_rebalance: bool = Field(
        True, description="a worker under KV pressure (parking, or requests waiting, with its "
                          "device KV migration_pressure_use full) moves running streams live "
                          "to workers with room")
    migration_pressure_use: float = Field(0.9, gt=0, le=1,
                                          description="device KV use counted as pressure")
    live_move_copy_share: float = Field(
        0.02, gt=0, le=1, description="share of the source's step time a live move's "
                                      "pre-copy round may spend copying")
    live_move_growth_tokens: int = Field(
        256, ge=0, description="tokens a live move's target reserves for the stream's growth")

    # disaggregated serving: prefill on one worker, decode on another (docs/serving.md)
    prefill_workers: int = Field(
        0, ge=0, description="prefill workers: they run prompts, send the first token and "
                             "hand the streams to decode workers (with decode_workers)")
    decode_workers: int = Field(
        0, ge=0, description="decode workers: they take streams from prefill workers and "
                             "prefill short prompts themselves (with prefill_workers)")
    prefill_gpus_per_worker: float | None = Field(
        None, ge=0, description="a prefill worker's GPUs; None = num_gpus_per_worker")
    decode_gpus_per_worker: float | None = Field(
        None, ge=0, description="a decode worker's GPUs; None = num_gpus_per_worker")
    prefill_tensor_parallel_size: int | None = Field(
        None, ge=1, description="a prefill worker's tensor-parallel size; None = "
                                "tensor_parallel_size")
    decode_tensor_parallel_size: int | None = Field(
        None, ge=1, description="a decode worker's tensor-parallel size; None = "
                                "tensor_parallel_size")
    disagg_min_prompt_tokens: int = Field(
        DEFAULT_DISAGG_MIN_PROMPT_TOKENS, ge=0,
        description="prompts shorter than this are prefilled on their decode worker")
    disagg_local_prefix_share: float = Field(
        0.5, ge=0, le=1, description="prompts this share of which is cached on their decode "
                                     "worker are prefilled there")
    disagg_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="a hand-off that fails: recompute the stream on a decode "
                                 "worker, or fail the request")
    disagg_lease_s: float = Field(
        60.0, gt=0, description="a decode worker's reservation, or a prefill worker's held "
                                "stream, that nobody renews or sends for this long is freed")

    # the workers of every base model (set on each of per_model's configs): a worker's CPU
    # threads default to the node's cores divided by them
    _cpu_share_workers: int = PrivateAttr(0)

    @model_validator(mode="before")
    @classmethod
    def _model_list(cls, data: Any) -> Any:
        # `--model` given more than once, or a list in a config: the first is `model`, the
        # others are served beside it (`models`)
        if not isinstance(data, dict) or not isinstance(data.get("model"), (list, tuple)):
            return data
        given = [ModelEntry.model_validate(m) for m in data["model"]]
        data = {**data, "model": None}
        if not given:
            return data
        first, rest = given[0], given[1:]
        data["model"] = first.model
        for key in ("served_model_name", "num_workers"):
            value = getattr(first, key)
            if value is None:
                continue
            if data.get(key) is not None and data[key] != value:
                raise ValueError(f"the first model's {key} ({value}) differs from {key} "
                                 f"({data[key]}); set it once")
            data[key] = value
        data["models"] = [*rest, *(data.get("models") or [])]
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_mixed_with_roles(cls, data: Any) -> Any:
        # with prefill and decode workers, the mixed workers default to none
        if (isinstance(data, dict) and "num_workers" not in data
                and (data.get("prefill_workers") or data.get("decode_workers"))):
            data = {**data, "num_workers": 0}
        return data

    @model_validator(mode="after")
    def _autoscaling_mixed_only(self) -> ServeConfig:
        # (before the role and autoscaling checks: this is the one error such a config gets)
        if self.autoscaling is not None and (self.prefill_workers or self.decode_workers):
            raise ValueError(
                "autoscaling works on mixed workers only; autoscaling (--min-workers, "
                "--max-workers) cannot be combined with prefill_workers and decode_workers "
                "(--prefill-workers, --decode-workers): drop one of them")
        return self

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_workers or self.decode_workers)

    @property
    def total_workers(self) -> int:
        return self.num_workers + self.prefill_workers + self.decode_workers

    def roles(self) -> list[str]:
        """Each worker's role, by index (prefill workers first); [] = all mixed."""
        if not self.disaggregated:
            return []
        return ["prefill"] * self.prefill_workers + ["decode"] * self.decode_workers

    def role_gpus(self, role: str) -> float:
        g = self.prefill_gpus_per_worker if role == "prefill" else \
            self.decode_gpus_per_worker if role == "decode" else None
        return self.num_gpus_per_worker if g is None else g

    def role_tensor_parallel_size(self, role: str) -> int:
        tp = self.prefill_tensor_parallel_size if role == "prefill" else \
            self.decode_tensor_parallel_size if role == "decode" else None
        return self.tensor_parallel_size if tp is None else tp

    @model_validator(mode="after")
    def _check_roles(self) -> ServeConfig:
        if not self.disaggregated:
            if self.num_workers < 1:
                raise ValueError("num_workers (--workers) must be at least 1 (or give "
                                 "prefill_workers and decode_workers)")
            for name in ("prefill_gpus_per_worker", "decode_gpus_per_worker",
                         "prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs prefill_workers and decode_workers "
                                     "(--prefill-workers, --decode-workers)")
            return self
        if not (self.prefill_workers and self.decode_workers):
            have, need = (("prefill_workers", "decode_workers") if self.prefill_workers
                          else ("decode_workers", "prefill_workers"))
            raise ValueError(f"{have} (--{have.replace('_', '-')}) needs {need} "
                             f"(--{need.replace('_', '-')}) too: prefill workers hand their "
                             "streams to decode workers")
        if self.num_workers:
            raise ValueError(f"num_workers (--workers) {self.num_workers} mixed workers cannot "
                             "be combined with prefill and decode workers: set it to 0")
        for role in ("prefill", "decode"):
            tp, gpus = self.role_tensor_parallel_size(role), self.role_gpus(role)
            if tp > 1 and gpus > 0 and gpus != tp:
                raise ValueError(f"a {role} worker with tensor-parallel size {tp} runs one rank "
                                 f"per GPU: {role}_gpus_per_worker must be {tp}, got {gpus:g}")
            if tp > 1 and gpus == 0 and self.num_cpus_per_worker == 0:
                raise ValueError("a tensor-parallel worker reserves its devices as a placement "
                                 "group: num_cpus_per_worker must be > 0 on CPU workers")
        on_gpu = {r: self.role_gpus(r) > 0 for r in ("prefill", "decode")}
        if on_gpu["prefill"] != on_gpu["decode"] and self.engine.get("dtype", "auto") == "auto":
            gpu, cpu = ("prefill", "decode") if on_gpu["prefill"] else ("decode", "prefill")
            raise ValueError(f"{gpu} workers run on GPUs (bfloat16 KV) and {cpu} workers on the "
                             "CPU (float32 KV): their KV cannot be exchanged; give both roles "
                             "GPUs, or one dtype (engine.dtype, --dtype)")
        return self

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, v: Any) -> Any:
        return parse_speculative_config(v) if isinstance(v, str) else v

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @field_validator("loras", mode="before")
    @classmethod
    def _lora_list(cls, v: Any) -> Any:
        """A list of 'NAME=PATH' strings or {name, path} objects (the CLI's, the chart's)."""
        if not isinstance(v, list):
            return v
        out: dict[str, str] = {}
        for item in v:
            if isinstance(item, str) and "=" in item:
                name, path = item.split("=", 1)
            elif isinstance(item, dict) and set(item) == {"name", "path"}:
                name, path = item["name"], item["path"]
            else:
                raise ValueError(f"a LoRA adapter is NAME=PATH or {{name, path}}, got {item!r}")
            name, path = str(name).strip(), str(path).strip()
            if not name or not path:
                raise ValueError(f"a LoRA adapter needs a name and a path, got {item!r}")
            if name in out:
                raise ValueError(f"LoRA adapter {name!r} is named twice")
            out[name] = path
        return out

    @field_validator("routing_policy")
    @classmethod
    def _check_policy(cls, v: str) -> str:
        from kvserve.router.policy import POLICIES

        if v not in POLICIES:
            raise ValueError(f"routing_policy {v!r} is not one of {', '.join(sorted(POLICIES))}")
        return v

    @field_validator("ssl_certfile", "ssl_keyfile", "ssl_ca_certs")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        # Serve's proxies do not run in this process's directory
        return os.path.abspath(os.path.expanduser(v)) if v else None

    @model_validator(mode="after")
    def _check_tls(self) -> ServeConfig:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            given, missing = (("ssl_certfile", "ssl_keyfile") if self.ssl_certfile
                              else ("ssl_keyfile", "ssl_certfile"))
            raise ValueError(f"{given} (--{given.replace('_', '-')}) needs {missing} "
                             f"(--{missing.replace('_', '-')}): TLS takes a certificate and "
                             "its key")
        if self.ssl_ca_certs and not self.ssl_certfile:
            raise ValueError("ssl_ca_certs (--ssl-ca-certs: client certificates) needs TLS: "
                             "set ssl_certfile and ssl_keyfile too")
        return self

    @model_validator(mode="after")
    def _check_autoscaling(self) -> ServeConfig:
        a = self.autoscaling
        if a is None:
            return self
        lo = max(1, a.min_workers)
        if "num_workers" not in self.model_fields_set:
            self.num_workers = lo
            self.model_fields_set.add("num_workers")  # (validate_assignment is off)
        elif not lo <= self.num_workers <= a.max_workers:
            raise ValueError(f"num_workers ({self.num_workers}) is the worker count autoscaling "
                             f"starts with: it must be within [max(1, min_workers), "
                             f"max_workers] = [{lo}, {a.max_workers}]")
        return self

    def most_workers(self) -> int:
        """The most workers this app may run at once (the placement check's demand), those
        of every base model together."""
        return max(self.num_workers, self.autoscaling.max_workers if self.autoscaling else 0) \
            + sum(m.num_workers or self.num_workers for m in self.models)

    @property
    def tls(self) -> bool:
        """Whether both APIs serve TLS."""
        return bool(self.ssl_certfile)

    @model_validator(mode="after")
    def _check_models(self) -> ServeConfig:
        if not self.models:
            return self
        # what works per model today: a fixed pool of mixed workers each, LoRA adapters
        # on the first model; anything else is refused rather than half applied
        for what, given in (
                ("prefill_workers and decode_workers (--prefill-workers, --decode-workers)",
                 self.disaggregated),
                ("autoscaling (--min-workers, --max-workers)", self.autoscaling is not None),
                ("speculative_config (--speculative-config)",
                 self.speculative_config is not None
                 or self.engine.get("speculative_config") is not None)):
            if given:
                raise ValueError(f"{what} cannot be combined with several base models "
                                 f"({', '.join(self.model_names())}) yet: serve one base "
                                 "model per service for it")
        names = self.model_names()
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"base model name(s) {', '.join(map(repr, twice))} served twice: "
                             "give each model its own served_model_name")
        clash = sorted(set(names) & set(self.loras))
        if clash:
            raise ValueError(f"LoRA adapter name(s) {', '.join(map(repr, clash))} are base "
                             "model names")
        return self

    def model_names(self) -> list[str]:
        """The served name of every base model, the first (`model`) first."""
        return [self.model_name(), *(m.name() for m in self.models)]

    def per_model(self) -> list[ServeConfig]:
        """One configuration per base model, each with one model, its workers and its
        router. The first keeps this config's names (router, workers), so a service of
        one model is the same with or without this split; the others' routers are named
        after their index. LoRA adapters belong to the first model."""
        if not self.models:
            return [self]
        out = self._split()
        for c in out:  # their workers share the nodes' cores
            c._cpu_share_workers = sum(x.num_workers for x in out)
        return out

    def _split(self) -> list[ServeConfig]:
        first = self.model_copy(update={"models": []})
        return [first, *(self.model_copy(update={
            "models": [], "model": m.model, "served_model_name": m.served_model_name,
            "num_workers": m.num_workers or self.num_workers,
            "router_name": model_router_name(self.router_name, i),
            "loras": {}, "enable_lora": False})
            for i, m in enumerate(self.models, 1))]

    def router_names(self) -> list[str]:
        """Every base model's router, the first model's first."""
        return [c.router_name for c in self.per_model()]

    @field_validator("engine")
    @classmethod
    def _check_engine(cls, v: dict[str, Any]) -> dict[str, Any]:
        EngineConfig(**{k: x for k, x in v.items() if k != "model"})  # fail early on a typo
        return v

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> ServeConfig:
        tp = self.tensor_parallel_size
        in_engine = self.engine.get("tensor_parallel_size")
        if in_engine is not None and in_engine != tp:
            raise ValueError(f"engine.tensor_parallel_size {in_engine} differs from "
                             f"tensor_parallel_size {tp}; set it once")
        in_engine = self.engine.get("speculative_config")
        if in_engine is not None and self.speculative_config is not None and \
                parse_speculative_config(in_engine) != self.speculative_config:
            raise ValueError("engine.speculative_config differs from speculative_config; set it "
                             "once")
        gpus = self.num_gpus_per_worker
        if tp > 1 and gpus > 0 and gpus != tp:
            raise ValueError(f"a worker with tensor_parallel_size {tp} runs one rank per GPU: "
                             f"num_gpus_per_worker (--gpus-per-worker) must be {tp}, got {gpus:g}")
        if tp > 1 and gpus == 0 and self.num_cpus_per_worker == 0:
            raise ValueError("a tensor-parallel worker reserves its devices as a placement "
                             "group: num_cpus_per_worker must be > 0 on CPU workers")
        return self

    def worker_engine(self, node_cores: int) -> dict[str, Any]:
        """A worker's EngineConfig; on CPU, unset torch threads share the node's cores."""
        return self.router_config().worker_engine(node_cores)

    def with_proxy_defaults(self) -> ServeConfig:
        """This config with the proxies' settings `kvserve serve` uses where unset."""
        return self.model_copy(update={
            "grpc_port": DEFAULT_GRPC_PORT if self.grpc_port is None else self.grpc_port,
            "http_port": DEFAULT_HTTP_PORT if self.http_port is None else self.http_port,
            "http_host": DEFAULT_HTTP_HOST if self.http_host is None else self.http_host,
        })

    def router_config(self) -> RouterConfig:
        role_engine = {r: {"tensor_parallel_size": self.role_tensor_parallel_size(r)}
                       for r in ("prefill", "decode")
                       if self.disaggregated
                       and self.role_tensor_parallel_size(r) != self.tensor_parallel_size}
        role_gpus = {r: self.role_gpus(r) for r in ("prefill", "decode")
                     if self.disaggregated and self.role_gpus(r) != self.num_gpus_per_worker}
        return RouterConfig(
            num_workers=self.total_workers, engine=self.engine_config().model_dump(),
            num_cpus_per_worker=self.num_cpus_per_worker,
            num_gpus_per_worker=self.num_gpus_per_worker,
            stream_interval_ms=self.stream_interval_ms, routing_policy=self.routing_policy,
            max_imbalance=self.max_imbalance, max_inflight_per_worker=self.max_inflight_per_worker,
            load_poll_interval_s=self.load_poll_interval_s, model_name=self.model_name(),
            slot_grace_s=self.slot_grace_s, placement_timeout_s=self.placement_timeout_s,
            autoscaling=asdict(self.autoscaling.policy()) if self.autoscaling else {},
            migration={"enabled": self.migration,
                       "park_threshold_s": self.migration_park_threshold_s,
                       "max_inflight": self.migration_max_inflight,
                       "min_interval_s": self.migration_min_interval_s,
                       "headroom": self.migration_headroom,
                       "live": self.migration_live, "rebalance": self.migration_rebalance,
                       "pressure_use": self.migration_pressure_use,
                       "copy_share": self.live_move_copy_share,
                       "growth_tokens": self.live_move_growth_tokens},
            roles=self.roles(), role_engine=role_engine, role_gpus=role_gpus,
            disagg={"min_prompt_tokens": self.disagg_min_prompt_tokens,
                    "local_prefix_share": self.disagg_local_prefix_share,
                    "failure_policy": self.disagg_failure_policy,
                    "lease_s": self.disagg_lease_s,
                    "growth_tokens": self.live_move_growth_tokens},
            cpu_share_workers=self._cpu_share_workers,
        )

    def engine_config(self) -> EngineConfig:
        lora: dict[str, Any] = {}
        if self.loras or self.enable_lora:
            lora = {"loras": self.loras, "enable_lora": True, "max_loras": self.max_loras,
                    "max_lora_rank": self.max_lora_rank, "max_cpu_loras": self.max_cpu_loras}
        if self.speculative_config is not None:
            lora["speculative_config"] = self.speculative_config
        return EngineConfig(**{**self.engine, "model": self.model,
                               "tensor_parallel_size": self.tensor_parallel_size, **lora})

    @model_validator(mode="after")
    def _check_lora(self) -> ServeConfig:
        if self.loras or self.enable_lora:
            name = self.model_name() if self.served_model_name or self.model is None else None
            if name is not None and name in self.loras:
                raise ValueError(f"LoRA adapter name {name!r} is the served model's name")
            self.engine_config()  # the engine's own checks (max_cpu_loras, names, TP)
        return self

    def resolved_api_keys(self) -> list[str]:
        """Configured keys plus those in $KVSERVE_API_KEYS (comma separated)."""
        env = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        return list(dict.fromkeys([*self.api_keys, *env]))

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        from kvserve.models import served_name

        return served_name(self.model)
