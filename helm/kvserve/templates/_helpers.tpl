{{/* Names, labels and shared pieces of the Ray pod specs. */}}

{{- define "kvserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: "<release>-<chart>" (or the release name when it contains the chart name).
At most 40 characters: KubeRay derives the Ray cluster's name (plus a 5-character suffix),
its pods' and its Services' names from the RayService's name.
*/}}
{{- define "kvserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object the chart creates. */}}
{{- define "kvserve.labels" -}}
helm.sh/chart: {{ include "kvserve.chart" . }}
{{ include "kvserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector labels. Ray pods carry these (KubeRay sets app.kubernetes.io/name=kuberay and
app.kubernetes.io/created-by on them, so the chart uses part-of and instance instead).
*/}}
{{- define "kvserve.selectorLabels" -}}
app.kubernetes.io/part-of: {{ include "kvserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Names of the objects (KubeRay names its own Services after the RayService). */}}
{{- define "kvserve.httpServiceName" -}}
{{- printf "%s-http" (include "kvserve.fullname" .) }}
{{- end }}
{{- define "kvserve.grpcServiceName" -}}
{{- printf "%s-grpc" (include "kvserve.fullname" .) }}
{{- end }}
{{- define "kvserve.headServiceName" -}}
{{- printf "%s-head-svc" (include "kvserve.fullname" .) }}
{{- end }}
{{- define "kvserve.apiKeysSecretName" -}}
{{- if .Values.apiKeys.existingSecret }}
{{- .Values.apiKeys.existingSecret }}
{{- else }}
{{- printf "%s-api-keys" (include "kvserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* The Secret holding the API's certificate (tls.crt) and key (tls.key). */}}
{{- define "kvserve.tlsSecretName" -}}
{{- if .Values.tls.existingSecret }}
{{- .Values.tls.existingSecret }}
{{- else }}
{{- printf "%s-tls" (include "kvserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* The certificate files in the Ray containers, as the serve config names them. */}}
{{- define "kvserve.tlsFile" -}}
{{- printf "%s/%s" (trimSuffix "/" .root.Values.tls.mountPath) .file }}
{{- end }}

{{- define "kvserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* True (non-empty) when the Ray containers get $KVSERVE_API_KEYS. */}}
{{- define "kvserve.apiKeysEnabled" -}}
{{- if or .Values.apiKeys.existingSecret .Values.apiKeys.keys }}true{{ end }}
{{- end }}

{{/* The model in the serve config: the Hub name (with @revision), the path in the pods, or ""
for the embedded default model. */}}
{{- define "kvserve.modelPath" -}}
{{- if .Values.model.id }}
{{- .Values.model.id }}{{ with .Values.model.revision }}@{{ . }}{{ end }}
{{- else }}
{{- with .Values.model.path }}
{{- if hasPrefix "/" . }}{{ . }}{{ else }}{{ printf "%s/%s" (trimSuffix "/" $.Values.model.mountPath) . }}{{ end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Fails the render on inconsistent values (a clear message instead of a broken cluster). */}}
{{- define "kvserve.validate" -}}
{{- $v := .Values.model.volume }}
{{- if and $v.persistentVolumeClaim $v.hostPath }}
{{- fail "model.volume: set persistentVolumeClaim or hostPath, not both" }}
{{- end }}
{{- if and .Values.model.id .Values.model.path }}
{{- fail "model: set id (a Hugging Face Hub name) or path (a file on a volume), not both" }}
{{- end }}
{{- if and .Values.model.revision (not .Values.model.id) }}
{{- fail "model.revision needs model.id (a Hugging Face Hub name)" }}
{{- end }}
{{- if and .Values.model.path (not (hasPrefix "/" .Values.model.path)) (not (or $v.persistentVolumeClaim $v.hostPath)) }}
{{- fail "model.path is relative to the model volume: set model.volume.persistentVolumeClaim or model.volume.hostPath (or give an absolute path inside the image)" }}
{{- end }}
{{- if and (gt (float64 .Values.serve.numGpusPerWorker) 0.0) (eq (int .Values.workerGroup.gpus) 0) }}
{{- fail "serve.numGpusPerWorker > 0 needs GPU worker pods: set workerGroup.gpus (and a -gpu image tag)" }}
{{- end }}
{{- if and .Values.serve.autoscaling.enabled (or (gt (int .Values.serve.prefill.workers) 0) (gt (int .Values.serve.decode.workers) 0)) }}
{{- fail "autoscaling works on mixed workers only; serve.autoscaling.enabled cannot be combined with serve.prefill.workers and serve.decode.workers: turn one of them off" }}
{{- end }}
{{- include "kvserve.validateRoles" . }}
{{- /* mixed workers of every base model (model, and each of models) */}}
{{- $all := int .Values.serve.numWorkers }}
{{- range .Values.models | default list }}{{ $all = add $all (.workers | default $.Values.serve.numWorkers) }}{{ end }}
{{- $count := ternary "serve.numWorkers" "the workers of all base models (serve.numWorkers and models[].workers)" (eq $all (int .Values.serve.numWorkers)) }}
{{- $need := mulf (float64 $all) (float64 .Values.serve.numGpusPerWorker) }}
{{- $have := mulf (float64 .Values.workerGroup.maxReplicas) (float64 .Values.workerGroup.gpus) }}
{{- if gt $need $have }}
{{- fail (printf "%s x serve.numGpusPerWorker = %v GPUs, but the worker group has at most workerGroup.maxReplicas x workerGroup.gpus = %v" $count $need $have) }}
{{- end }}
{{- include "kvserve.validateAutoscaling" . }}
{{- $tp := int .Values.serve.tensorParallelSize }}
{{- $gpw := float64 .Values.serve.numGpusPerWorker }}
{{- with .Values.serve.engine }}
{{- if and (hasKey . "tensor_parallel_size") (ne (int (get . "tensor_parallel_size")) $tp) }}
{{- fail "serve.engine.tensor_parallel_size differs from serve.tensorParallelSize: set serve.tensorParallelSize only" }}
{{- end }}
{{- end }}
{{- if and (gt $tp 1) (gt $gpw 0.0) }}
{{- if ne $gpw (float64 $tp) }}
{{- fail (printf "serve.tensorParallelSize %d runs one rank per GPU: serve.numGpusPerWorker must be %d, not %v" $tp $tp .Values.serve.numGpusPerWorker) }}
{{- end }}
{{- $pod := int .Values.workerGroup.gpus }}
{{- if lt $pod $tp }}
{{- fail (printf "a worker's %d GPUs (serve.tensorParallelSize) must be in one pod: workerGroup.gpus is %d" $tp $pod) }}
{{- end }}
{{- $fit := mul (div $pod $tp) (int .Values.workerGroup.maxReplicas) }}
{{- if lt $fit $all }}
{{- fail (printf "%s %d tensor-parallel workers of %d GPUs each, but the worker pods hold at most %d (workerGroup.maxReplicas x (workerGroup.gpus / serve.tensorParallelSize))" $count $all $tp $fit) }}
{{- end }}
{{- end }}
{{- if and (gt $tp 1) (eq $gpw 0.0) (eq (float64 .Values.serve.numCpusPerWorker) 0.0) }}
{{- fail "a tensor-parallel CPU worker reserves its CPUs as a placement group: serve.numCpusPerWorker must be > 0" }}
{{- end }}
{{- if gt (int .Values.workerGroup.minReplicas) (int .Values.workerGroup.maxReplicas) }}
{{- fail "workerGroup.minReplicas must not exceed workerGroup.maxReplicas" }}
{{- end }}
{{- include "kvserve.validateTls" . }}
{{- end }}

{{/*
kvserve's autoscaling: its bounds, and a worker group that can hold maxWorkers (pods Ray's
autoscaler adds where the running ones cannot).
*/}}
{{- define "kvserve.validateAutoscaling" -}}
{{- $a := .Values.serve.autoscaling }}
{{- if $a.enabled }}
{{- $lo := int $a.minWorkers }}
{{- $hi := int $a.maxWorkers }}
{{- if gt $lo $hi }}
{{- fail (printf "serve.autoscaling.minWorkers (%d) must not exceed serve.autoscaling.maxWorkers (%d)" $lo $hi) }}
{{- end }}
{{- $n := int .Values.serve.numWorkers }}
{{- if or (lt $n (max 1 $lo)) (gt $n $hi) }}
{{- fail (printf "serve.numWorkers (%d) is where autoscaling starts: it must be within [max(1, serve.autoscaling.minWorkers), serve.autoscaling.maxWorkers] = [%d, %d]" $n (max 1 $lo) $hi) }}
{{- end }}
{{- if not (lt (float64 $a.downscaleKvUse) (float64 $a.upscaleKvUse)) }}
{{- fail "serve.autoscaling.downscaleKvUse must be below serve.autoscaling.upscaleKvUse" }}
{{- end }}
{{- /* workers one worker pod holds: by GPUs, else by the CPUs Ray sees in the pod */}}
{{- $perPod := 0 }}
{{- $by := "" }}
{{- $gpw := float64 .Values.serve.numGpusPerWorker }}
{{- $cpw := float64 .Values.serve.numCpusPerWorker }}
{{- if gt $gpw 0.0 }}
{{- $perPod = int (floor (divf (float64 .Values.workerGroup.gpus) $gpw)) }}
{{- $by = "workerGroup.gpus / serve.numGpusPerWorker" }}
{{- else if gt $cpw 0.0 }}
{{- $cpu := toString (index .Values.workerGroup.rayStartParams "num-cpus" | default (.Values.workerGroup.resources.limits | default dict).cpu | default (.Values.workerGroup.resources.requests | default dict).cpu | default "0") }}
{{- $cores := 0.0 }}
{{- if hasSuffix "m" $cpu }}
{{- $cores = divf (float64 (trimSuffix "m" $cpu)) 1000.0 }}
{{- else }}
{{- $cores = float64 $cpu }}
{{- end }}
{{- $perPod = int (floor (addf (divf $cores $cpw) 0.000001)) }}
{{- $by = "the pod's CPUs / serve.numCpusPerWorker" }}
{{- end }}
{{- if gt $perPod 0 }}
{{- $pods := int (ceil (divf (float64 $hi) (float64 $perPod))) }}
{{- if lt (int .Values.workerGroup.maxReplicas) $pods }}
{{- fail (printf "serve.autoscaling.maxWorkers %d needs %d worker pods (%d per pod: %s), but workerGroup.maxReplicas is %d" $hi $pods $perPod $by (int .Values.workerGroup.maxReplicas)) }}
{{- end }}
{{- if and (not .Values.autoscaling.enabled) (lt (int .Values.workerGroup.replicas) $pods) }}
{{- fail (printf "serve.autoscaling.maxWorkers %d needs %d worker pods (%d per pod: %s), and workerGroup.replicas starts %d: turn on autoscaling.enabled (Ray's autoscaler adds the pods the workers wait for) or raise workerGroup.replicas" $hi $pods $perPod $by (int .Values.workerGroup.replicas)) }}
{{- end }}
{{- else if gt $gpw 0.0 }}
{{- fail (printf "a worker pod holds no worker: workerGroup.gpus %d < serve.numGpusPerWorker %v" (int .Values.workerGroup.gpus) .Values.serve.numGpusPerWorker) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Prefill and decode worker values that cannot work together fail the render. */}}
{{- define "kvserve.validateRoles" -}}
{{- $s := .Values.serve }}
{{- $p := int $s.prefill.workers }}
{{- $d := int $s.decode.workers }}
{{- if and (eq $p 0) (eq $d 0) }}
{{- if eq (int $s.numWorkers) 0 }}
{{- fail "serve.numWorkers must be at least 1 (or set serve.prefill.workers and serve.decode.workers)" }}
{{- end }}
{{- range $k := list "prefill" "decode" }}
{{- $r := get $s $k }}
{{- if or (not (kindIs "invalid" $r.gpusPerWorker)) (not (kindIs "invalid" $r.tensorParallelSize)) }}
{{- fail (printf "serve.%s.gpusPerWorker and serve.%s.tensorParallelSize need serve.prefill.workers and serve.decode.workers" $k $k) }}
{{- end }}
{{- end }}
{{- else }}
{{- if or (eq $p 0) (eq $d 0) }}
{{- fail "serve.prefill.workers and serve.decode.workers go together: prefill workers hand their streams to decode workers" }}
{{- end }}
{{- if gt (int $s.numWorkers) 0 }}
{{- fail "serve.prefill.workers and serve.decode.workers replace the mixed workers: set serve.numWorkers to 0" }}
{{- end }}
{{- $need := 0.0 }}
{{- $ongpu := dict }}
{{- range $k := list "prefill" "decode" }}
{{- $r := get $s $k }}
{{- $g := float64 $s.numGpusPerWorker }}
{{- if not (kindIs "invalid" $r.gpusPerWorker) }}{{ $g = float64 $r.gpusPerWorker }}{{ end }}
{{- $tp := int $s.tensorParallelSize }}
{{- if not (kindIs "invalid" $r.tensorParallelSize) }}{{ $tp = int $r.tensorParallelSize }}{{ end }}
{{- if and (gt $tp 1) (gt $g 0.0) (ne $g (float64 $tp)) }}
{{- fail (printf "a %s worker with tensor-parallel size %d runs one rank per GPU: serve.%s.gpusPerWorker must be %d, not %v" $k $tp $k $tp $g) }}
{{- end }}
{{- if and (gt $tp 1) (gt $g 0.0) (lt (int $.Values.workerGroup.gpus) $tp) }}
{{- fail (printf "a %s worker's %d GPUs must be in one pod: workerGroup.gpus is %d" $k $tp (int $.Values.workerGroup.gpus)) }}
{{- end }}
{{- $need = addf $need (mulf (float64 $r.workers) $g) }}
{{- $_ := set $ongpu $k (gt $g 0.0) }}
{{- end }}
{{- if and (gt $need 0.0) (eq (int .Values.workerGroup.gpus) 0) }}
{{- fail "prefill or decode workers with GPUs need GPU worker pods: set workerGroup.gpus (and a -gpu image tag)" }}
{{- end }}
{{- $have := mulf (float64 .Values.workerGroup.maxReplicas) (float64 .Values.workerGroup.gpus) }}
{{- if gt $need $have }}
{{- fail (printf "the prefill and decode workers need %v GPUs, but the worker group has at most workerGroup.maxReplicas x workerGroup.gpus = %v" $need $have) }}
{{- end }}
{{- $dtype := "auto" }}
{{- with $s.engine }}{{ if hasKey . "dtype" }}{{ $dtype = get . "dtype" }}{{ end }}{{ end }}
{{- if and (ne (get $ongpu "prefill") (get $ongpu "decode")) (eq $dtype "auto") }}
{{- fail "prefill and decode workers on GPUs and on the CPU have other KV dtypes (bfloat16, float32) and cannot exchange KV: give both roles GPUs, or set serve.engine.dtype" }}
{{- end }}
{{- end }}
{{- end }}

{{/* TLS values that cannot work together fail the render. */}}
{{- define "kvserve.validateTls" -}}
{{- $t := .Values.tls }}
{{- if and $t.key (not $t.cert) }}
{{- fail "tls.key is set without tls.cert: the chart needs the certificate of that key" }}
{{- end }}
{{- if and $t.cert (not $t.key) }}
{{- fail "tls.cert is set without tls.key: the chart needs the certificate's private key" }}
{{- end }}
{{- $sources := 0 }}
{{- if $t.existingSecret }}{{ $sources = add1 $sources }}{{ end }}
{{- if $t.certManager.enabled }}{{ $sources = add1 $sources }}{{ end }}
{{- if $t.cert }}{{ $sources = add1 $sources }}{{ end }}
{{- if $t.enabled }}
{{- if eq $sources 0 }}
{{- fail "tls.enabled needs a certificate: tls.existingSecret, tls.certManager.enabled, or tls.cert and tls.key" }}
{{- end }}
{{- if gt $sources 1 }}
{{- fail "tls: set one of tls.existingSecret, tls.certManager.enabled, or tls.cert and tls.key" }}
{{- end }}
{{- if and $t.certManager.enabled (not $t.certManager.issuerRef.name) }}
{{- fail "tls.certManager.enabled needs tls.certManager.issuerRef.name (the Issuer or ClusterIssuer that signs it)" }}
{{- end }}
{{- if and $t.clientCA.enabled $t.cert (not $t.clientCA.ca) (not $t.clientCA.existingSecret) }}
{{- fail "tls.clientCA.enabled needs the CA: tls.clientCA.ca (with tls.cert and tls.key) or tls.clientCA.existingSecret" }}
{{- end }}
{{- if and $t.clientCA.ca (not $t.cert) }}
{{- fail "tls.clientCA.ca goes into the Secret the chart creates from tls.cert and tls.key; with another Secret, put the CA in a Secret and name it in tls.clientCA.existingSecret" }}
{{- end }}
{{- if and $t.clientCA.ca (not $t.clientCA.enabled) }}
{{- fail "tls.clientCA.ca is set but tls.clientCA.enabled is false" }}
{{- end }}
{{- if has (int $t.healthPort) (list (int .Values.serve.httpPort) (int .Values.serve.grpcPort) (int .Values.monitoring.metricsPort) (int .Values.probes.agentPort)) }}
{{- fail (printf "tls.healthPort %d is another port of the pod: pick a free one" (int $t.healthPort)) }}
{{- end }}
{{- else if or (gt $sources 0) $t.clientCA.enabled }}
{{- fail "tls: a certificate (or tls.clientCA) is set but tls.enabled is false; set tls.enabled: true to serve TLS" }}
{{- end }}
{{- end }}

{{/* "true" when a base model (model, or one of models) comes from the Hugging Face Hub. */}}
{{- define "kvserve.fromHub" -}}
{{- $hub := .Values.model.id }}
{{- range .Values.models | default list }}{{ if .id }}{{ $hub = true }}{{ end }}{{ end }}
{{- if $hub }}true{{ end }}
{{- end }}

{{/* Volumes of every Ray pod: /dev/shm in memory, and the model volume if any. */}}
{{- define "kvserve.volumes" -}}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
{{- with .Values.model.volume }}
{{- if .persistentVolumeClaim }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .persistentVolumeClaim }}
    readOnly: true
{{- else if .hostPath }}
- name: model
  hostPath:
    path: {{ .hostPath }}
    type: {{ .hostPathType }}
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  projected:
    defaultMode: 0440
    sources:
      - secret:
          name: {{ include "kvserve.tlsSecretName" . }}
          items:
            - key: tls.crt
              path: tls.crt
            - key: tls.key
              path: tls.key
      {{- if .Values.tls.clientCA.enabled }}
      - secret:
          name: {{ .Values.tls.clientCA.existingSecret | default (include "kvserve.tlsSecretName" .) }}
          items:
            - key: {{ .Values.tls.clientCA.secretKey }}
              path: ca.crt
      {{- end }}
{{- end }}
{{- if include "kvserve.fromHub" . }}
{{- with .Values.model.cache }}
- name: hf-cache
{{- if .persistentVolumeClaim }}
  persistentVolumeClaim:
    claimName: {{ .persistentVolumeClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .sizeLimit }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvserve.volumeMounts" -}}
- name: shm
  mountPath: /dev/shm
{{- if or .Values.model.volume.persistentVolumeClaim .Values.model.volume.hostPath }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if include "kvserve.fromHub" . }}
- name: hf-cache
  mountPath: {{ .Values.model.cache.mountPath }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Environment of every Ray container. */}}
{{- define "kvserve.env" -}}
{{- if include "kvserve.apiKeysEnabled" . }}
- name: KVSERVE_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "kvserve.apiKeysSecretName" . }}
      key: {{ .Values.apiKeys.secretKey }}
{{- end }}
{{- if include "kvserve.fromHub" . }}
- name: HF_HOME
  value: {{ .Values.model.cache.mountPath | quote }}
{{- end }}
{{- with .Values.model.token.existingSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.model.token.secretKey }}
{{- end }}
{{- if .Values.model.offline }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Readiness and liveness probes: Ray's /api/healthz on the dashboard agent. */}}
{{- define "kvserve.probes" -}}
readinessProbe:
  httpGet:
    path: /api/healthz
    port: {{ .Values.probes.agentPort }}
  initialDelaySeconds: 10
  periodSeconds: {{ .Values.probes.readinessPeriodSeconds }}
  timeoutSeconds: {{ .Values.probes.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.readinessFailureThreshold }}
livenessProbe:
  httpGet:
    path: /api/healthz
    port: {{ .Values.probes.agentPort }}
  initialDelaySeconds: {{ .Values.probes.livenessInitialDelaySeconds }}
  periodSeconds: {{ .Values.probes.livenessPeriodSeconds }}
  timeoutSeconds: {{ .Values.probes.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.livenessFailureThreshold }}
{{- end }}

{{/* The serve config (serveConfigV2): same shape as deploy/serve_config.yaml. */}}
{{- define "kvserve.serveConfig" -}}
{{- $s := .Values.serve }}
{{- $engine := deepCopy ($s.engine | default dict) }}
{{- if not (kindIs "invalid" $s.hostCacheGib) }}
{{- $_ := set $engine "host_cache_gib" $s.hostCacheGib }}
{{- end }}
{{- $model := include "kvserve.modelPath" . }}
{{- $args := dict
  "model" (ternary $model nil (ne $model ""))
  "served_model_name" $s.servedModelName
  "num_workers" $s.numWorkers
  "num_gpus_per_worker" $s.numGpusPerWorker
  "num_cpus_per_worker" $s.numCpusPerWorker
  "tensor_parallel_size" $s.tensorParallelSize
  "speculative_config" $s.speculativeConfig
  "stream_interval_ms" $s.streamIntervalMs
  "engine" $engine
  "http_host" "0.0.0.0"
  "http_port" $s.httpPort
  "grpc_port" $s.grpcPort
  "api_keys" (list)
  "routing_policy" $s.routingPolicy
  "max_imbalance" $s.maxImbalance
  "max_inflight_per_worker" $s.maxInflightPerWorker
  "shutdown_grace_s" $s.shutdownGraceS
  "prefill_workers" $s.prefill.workers
  "decode_workers" $s.decode.workers
  "prefill_gpus_per_worker" $s.prefill.gpusPerWorker
  "decode_gpus_per_worker" $s.decode.gpusPerWorker
  "prefill_tensor_parallel_size" $s.prefill.tensorParallelSize
  "decode_tensor_parallel_size" $s.decode.tensorParallelSize
  "disagg_min_prompt_tokens" $s.disagg.minPromptTokens
  "disagg_local_prefix_share" $s.disagg.localPrefixShare
  "disagg_failure_policy" $s.disagg.failurePolicy
}}
{{- with $s.autoscaling }}
{{- if .enabled }}
{{- $_ := set $args "autoscaling" (dict
  "min_workers" .minWorkers "max_workers" .maxWorkers
  "upscale_delay_s" .upscaleDelayS "downscale_delay_s" .downscaleDelayS
  "downscale_to_zero_delay_s" .downscaleToZeroDelayS "max_step" .maxStep
  "upscale_kv_use" .upscaleKvUse "downscale_kv_use" .downscaleKvUse
  "upscale_waiting" .upscaleWaiting "upscale_ttft_s" .upscaleTtftS
  "ttft_window_s" .ttftWindowS "max_queued_requests" .maxQueuedRequests
  "queue_timeout_s" .queueTimeoutS "drain_timeout_s" .drainTimeoutS) }}
{{- end }}
{{- end }}
{{- $more := list }}
{{- range $i, $m := .Values.models | default list }}
{{- if and $m.id $m.path }}
{{- fail (printf "models[%d]: set id (a Hugging Face Hub name) or path (a file on the model volume), not both" $i) }}
{{- end }}
{{- if not (or $m.id $m.path) }}
{{- fail (printf "models[%d]: set id (a Hugging Face Hub name) or path (a file on the model volume)" $i) }}
{{- end }}
{{- if and $m.revision (not $m.id) }}
{{- fail (printf "models[%d].revision needs models[%d].id (a Hugging Face Hub name)" $i $i) }}
{{- end }}
{{- $p := $m.path }}
{{- if $m.id }}
{{- $p = $m.id }}
{{- with $m.revision }}{{ $p = printf "%s@%s" $p . }}{{ end }}
{{- else if not (hasPrefix "/" $m.path) }}
{{- if not (or $.Values.model.volume.persistentVolumeClaim $.Values.model.volume.hostPath) }}
{{- fail (printf "models[%d].path is relative to the model volume: set model.volume.persistentVolumeClaim or model.volume.hostPath (or give an absolute path inside the image)" $i) }}
{{- end }}
{{- $p = printf "%s/%s" (trimSuffix "/" $.Values.model.mountPath) $m.path }}
{{- end }}
{{- $e := dict "model" $p }}
{{- with $m.servedModelName }}{{ $_ := set $e "served_model_name" . }}{{ end }}
{{- with $m.workers }}{{ $_ := set $e "num_workers" . }}{{ end }}
{{- $more = append $more $e }}
{{- end }}
{{- if $more }}
{{- if or (and $s.autoscaling $s.autoscaling.enabled) $s.prefill.workers $s.decode.workers $s.speculativeConfig }}
{{- fail "models: several base models cannot be combined with serve.autoscaling, serve.prefill / serve.decode workers or serve.speculativeConfig yet; serve one base model per release for those" }}
{{- end }}
{{- $_ := set $args "models" $more }}
{{- end }}
{{- $lora := $s.lora | default dict }}
{{- if or $lora.enabled $lora.adapters }}
{{- $_ := set $args "enable_lora" true }}
{{- $_ := set $args "loras" ($lora.adapters | default list) }}
{{- $_ := set $args "max_loras" $lora.maxLoras }}
{{- $_ := set $args "max_lora_rank" $lora.maxLoraRank }}
{{- $_ := set $args "max_cpu_loras" $lora.maxCpuLoras }}
{{- end }}
{{- $http := dict "host" "0.0.0.0" "port" $s.httpPort }}
{{- $env := dict }}
{{- if .Values.tls.enabled }}
{{- $cert := include "kvserve.tlsFile" (dict "root" . "file" "tls.crt") }}
{{- $key := include "kvserve.tlsFile" (dict "root" . "file" "tls.key") }}
{{- $files := dict "ssl_certfile" $cert "ssl_keyfile" $key }}
{{- /* kvserve's hook in Serve's proxies (deploy/proxy_tls.py): gRPC TLS, client
certificates, the plaintext health port KubeRay checks */}}
{{- $env = dict "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH" "kvserve.deploy.proxy_tls.install" "KVSERVE_GRPC_SSL_CERTFILE" $cert "KVSERVE_GRPC_SSL_KEYFILE" $key "KVSERVE_PROXY_HEALTH_PORT" (toString .Values.tls.healthPort) }}
{{- if .Values.tls.clientCA.enabled }}
{{- $ca := include "kvserve.tlsFile" (dict "root" . "file" "ca.crt") }}
{{- $_ := set $files "ssl_ca_certs" $ca }}
{{- $_ := set $env "KVSERVE_GRPC_SSL_CA_CERTS" $ca }}
{{- end }}
{{- $args = merge $args $files }}
{{- $http = merge $http $files }}
{{- end }}
{{- $app := dict
  "name" "kvserve"
  "route_prefix" "/"
  "import_path" "kvserve.deploy.app:build_app"
  "args" $args
}}
{{- $cfg := dict
  "proxy_location" $s.proxyLocation
  "http_options" $http
  "grpc_options" (dict "port" $s.grpcPort "grpc_servicer_functions" (list "kvserve.deploy.grpc_servicer.add_KVServeServicer_to_server"))
  "applications" (list $app)
}}
{{- if $env }}
{{- $_ := set $cfg "controller_options" (dict "runtime_env" (dict "env_vars" $env)) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}
