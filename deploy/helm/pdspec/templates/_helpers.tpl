{{/* Names and labels shared by every template. */}}

{{/* 47 characters at most: names add up to 16 more ("-router-registry"), and a Service's name
     must fit a 63-character DNS label. */}}
{{- define "pdspec.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 47 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdspec.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdspec.labels" -}}
{{ include "pdspec.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The image follows config.engine.device unless image.tag pins one. */}}
{{- define "pdspec.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion (ternary "" "-cpu" (eq .Values.config.engine.device "cuda"))) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "pdspec.tokenSecretName" -}}
{{- .Values.clusterToken.existingSecret | default (printf "%s-token" (include "pdspec.fullname" .)) -}}
{{- end -}}

{{/* The router's HTTP port (the OpenAI API and its /metrics), or "" when config.router.http_port
is null (Helm drops a key set to null, so an override of null turns it off). */}}
{{- define "pdspec.httpPort" -}}
{{- with .Values.config.router.http_port -}}{{ int . }}{{- end -}}
{{- end -}}

{{/* Where workers register: a Service that also lists a router not yet ready (it is not ready
until workers have registered). */}}
{{- define "pdspec.routerAddress" -}}
{{- printf "%s-router-registry:%v" (include "pdspec.fullname" .) .Values.config.router.internal_port -}}
{{- end -}}

{{/* Checks that the schema cannot express: those about running in pods, and the config's own
cross-field rules (deploy/config.py's and router/config.py's validators, mirrored: values.schema.json
holds only per-field rules, and a config breaking one rendered fine, then every pod crash-looped). */}}
{{- define "pdspec.validate" -}}
{{- $c := .Values.config -}}
{{- if $c.cluster_token -}}
{{- fail "config.cluster_token: leave it unset, a ConfigMap is not secret; set clusterToken.value or clusterToken.existingSecret" -}}
{{- end -}}
{{- if $c.router.api_key_file -}}
{{- fail "config.router.api_key_file: leave it unset; set apiKeys.existingSecret, the chart mounts that Secret and names it" -}}
{{- end -}}
{{- if ne $c.router.host "0.0.0.0" -}}
{{- fail (printf "config.router.host: %v is not reachable from other pods; allowed: 0.0.0.0" $c.router.host) -}}
{{- end -}}
{{- if $c.tls -}}
{{- fail "config.tls: leave it unset; set tls.existingSecret, the chart mounts that Secret, fills config.tls and switches the probes to TLS-safe ones" -}}
{{- end -}}
{{- if not $c.router.internal_port -}}
{{- fail "config.router.internal_port: 0 (any free port) cannot be named by a Service; set a fixed port" -}}
{{- end -}}
{{- if not $c.router.port -}}
{{- fail "config.router.port: 0 (any free port) cannot be named by a Service; set a fixed port" -}}
{{- end -}}
{{- $http := $c.router.http_port -}}
{{- if not (kindIs "invalid" $http) -}}
{{- if not $http -}}
{{- fail "config.router.http_port: 0 (any free port) cannot be named by a Service; set a fixed port, or null to turn the HTTP API off" -}}
{{- end -}}
{{- if eq (int $http) (int $c.router.port) -}}
{{- fail (printf "config.router.http_port: %v is config.router.port, the gRPC API's; give HTTP a port of its own" (int $http)) -}}
{{- end -}}
{{- end -}}
{{- range $role := list "prefill" "decode" "aggregated" -}}
{{- $rc := get $c $role | default dict -}}
{{- if $rc.replicas -}}
{{- range $field := list "port" "metrics_port" -}}
{{- if not (get $rc $field) -}}
{{- fail (printf "config.%s.%s: 0 (any free port) cannot be named by probes and Services; set a fixed port" $role $field) -}}
{{- end -}}
{{- end -}}
{{- $gpus := int (($rc.resources | default dict).gpus | default 0) -}}
{{- $tp := int ($rc.tensor_parallel_size | default 1) -}}
{{- if and (eq (($c.engine | default dict).device | default "cpu") "cuda") (ne $gpus $tp) -}}
{{- fail (printf "config.%s.resources.gpus: %d, but engine.device is cuda with tensor_parallel_size %d: each rank drives one GPU, set gpus to %d" $role $gpus $tp $tp) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- include "pdspec.validateRoles" $c -}}
{{- end -}}

{{/* DeploymentConfig's and RouterConfig's model validators, with their messages. */}}
{{- define "pdspec.validateRoles" -}}
{{- $c := . -}}
{{- $engine := $c.engine | default dict -}}
{{- if not (kindIs "invalid" ($engine.num_threads | default nil)) -}}
{{- fail (printf "config.engine.num_threads: set it per role in a deployment (prefill.num_threads, decode.num_threads, aggregated.num_threads), not under engine (got %v)" $engine.num_threads) -}}
{{- end -}}
{{- if ne (int ($engine.tensor_parallel_size | default 1)) 1 -}}
{{- fail (printf "config.engine.tensor_parallel_size: set it per role in a deployment (prefill.tensor_parallel_size, decode.tensor_parallel_size, aggregated.tensor_parallel_size), not under engine (got %v)" $engine.tensor_parallel_size) -}}
{{- end -}}
{{- $prefill := $c.prefill | default dict -}}
{{- $decode := $c.decode | default dict -}}
{{- $aggregated := $c.aggregated | default dict -}}
{{- $p := int ($prefill.replicas | default 0) -}}
{{- $d := int ($decode.replicas | default 0) -}}
{{- if and (or $p $d) (not (and $p $d)) -}}
{{- fail (printf "config.prefill.replicas (%d) and config.decode.replicas (%d) must both be >= 1 for disaggregated serving, or both 0 with config.aggregated.replicas >= 1" $p $d) -}}
{{- end -}}
{{- if and (not (or $p $d)) (not (int ($aggregated.replicas | default 0))) -}}
{{- fail "config.aggregated.replicas: no workers: set config.prefill.replicas and config.decode.replicas, or config.aggregated.replicas" -}}
{{- end -}}
{{- range $role, $rc := dict "prefill" $prefill "decode" $decode "aggregated" $aggregated -}}
{{- if and $rc.port (eq (int $rc.port) (int ($rc.metrics_port | default 0))) -}}
{{- fail (printf "config.%s: port and metrics_port are both %v: a replica listens on each (gRPC and /metrics); give them different ports, or 0 (any free port)" $role (int $rc.port)) -}}
{{- end -}}
{{- end -}}
{{- range $role, $rc := dict "prefill" $prefill "decode" $decode -}}
{{- if and $rc.replicas (gt (int ($rc.tensor_parallel_size | default 1)) 1) -}}
{{- fail (printf "config.%s.tensor_parallel_size: %v is not supported for disaggregated roles yet (KV transfer between sharded workers is not implemented); allowed: 1, or use aggregated workers for tensor parallelism" $role $rc.tensor_parallel_size) -}}
{{- end -}}
{{- end -}}
{{- if ne ($aggregated.kv_transfer | default "nixl") "nixl" -}}
{{- fail (printf "config.aggregated.kv_transfer: %v does nothing, an aggregated worker moves no KV; leave it unset (config.prefill.kv_transfer and config.decode.kv_transfer choose)" $aggregated.kv_transfer) -}}
{{- end -}}
{{- if and $p (ne ($prefill.kv_transfer | default "nixl") ($decode.kv_transfer | default "nixl")) -}}
{{- fail (printf "config.prefill.kv_transfer (%v) and config.decode.kv_transfer (%v) must match: decode workers pull the way prefill workers serve" ($prefill.kv_transfer | default "nixl") ($decode.kv_transfer | default "nixl")) -}}
{{- end -}}
{{- $router := $c.router | default dict -}}
{{- $internal := int ($router.internal_port | default 50052) -}}
{{- if or (eq $internal (int ($router.port | default 50051))) (and $router.http_port (eq $internal (int $router.http_port))) -}}
{{- fail (printf "config.router.internal_port: %d is config.router.port or config.router.http_port; port, internal_port and http_port must differ" $internal) -}}
{{- end -}}
{{- $interval := float64 ($router.heartbeat_interval_s | default 0.5) -}}
{{- $timeout := float64 ($router.heartbeat_timeout_s | default 3.0) -}}
{{- if le $timeout $interval -}}
{{- fail (printf "config.router.heartbeat_timeout_s (%v) must exceed config.router.heartbeat_interval_s (%v): a worker would be evicted between its heartbeats" $timeout $interval) -}}
{{- end -}}
{{- end -}}

{{/* Env every pod gets: the cluster token and the user's extras. */}}
{{- define "pdspec.commonEnv" -}}
- name: PDSPEC_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdspec.tokenSecretName" . }}
      key: {{ .Values.clusterToken.key }}
# Converted models and compiled kernels land here (an emptyDir: kept across container restarts).
- name: PDSPEC_HOME
  value: /var/cache/pdspec
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The deployment config the pods read: .Values.config plus where the API keys' and TLS
Secrets are mounted. */}}
{{- define "pdspec.configYaml" -}}
{{- $config := deepCopy .Values.config }}
{{- if .Values.apiKeys.existingSecret }}
{{- $_ := set $config.router "api_key_file" (include "pdspec.apiKeyFile" .) }}
{{- end }}
{{- with .Values.tls.existingSecret }}
{{- $dir := include "pdspec.tlsDir" $ }}
{{- $_ := set $config "tls" (dict "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir)
                                  "ca_file" (printf "%s/ca.crt" $dir) "server_name" $.Values.tls.serverName) }}
{{- end }}
{{- toYaml $config }}
{{- end -}}

{{/* The config's hash in every pod's annotations, so a change rolls the pods: without each role's
replicas and resources, which no process reads (they shape the Deployments), so scaling a role
restarts no pod (the router's Recreate strategy made any restart an outage). */}}
{{- define "pdspec.configChecksum" -}}
{{- $config := include "pdspec.configYaml" . | fromYaml }}
{{- range $role := list "prefill" "decode" "aggregated" }}
{{- with get $config $role }}
{{- $_ := unset . "replicas" }}
{{- $_ := unset . "resources" }}
{{- end }}
{{- end }}
{{- toYaml $config | sha256sum }}
{{- end -}}

{{/* Pod-level fields every pod shares. */}}
{{- define "pdspec.podCommon" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pdspec.volumes" -}}
- name: config
  configMap:
    name: {{ include "pdspec.fullname" . }}-config
- name: cache
  emptyDir: {}
{{- with .Values.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- with .Values.volumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "pdspec.volumeMounts" -}}
- name: config
  mountPath: /etc/pdspec
  readOnly: true
- name: cache
  mountPath: /var/cache/pdspec
{{- if .Values.tls.existingSecret }}
- name: tls
  mountPath: {{ include "pdspec.tlsDir" . }}
  readOnly: true
{{- end }}
{{- with .Values.volumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Native gRPC probes: kubelet calls grpc.health.v1.Health (service "") on the port. The
kubelet's gRPC probes speak plaintext only: with TLS on, a router with its HTTP API is probed
there over HTTPS (/health, and /ready, which follows its route as the gRPC readiness does; the
kubelet checks no certificate, the API asks none), a worker on its plain-HTTP metrics port
(/health follows its engine, /ready its registration, as its gRPC health does), and a router
without HTTP only by its port accepting connections (tcpSocket; see values.yaml). */}}
{{- define "pdspec.probes" -}}
{{- $port := .port -}}
{{- $check := printf "grpc: {port: %v}" $port -}}
{{- $ready := $check -}}
{{- if .readyService }}{{ $ready = printf "grpc: {port: %v, service: %s}" $port .readyService }}{{ end -}}
{{- if and .root.Values.tls.existingSecret .httpPort }}
{{- $check = "httpGet: {path: /health, port: http, scheme: HTTPS}" }}{{ $ready = "httpGet: {path: /ready, port: http, scheme: HTTPS}" }}
{{- else if and .root.Values.tls.existingSecret .metricsPort }}
{{- $check = "httpGet: {path: /health, port: metrics}" }}{{ $ready = "httpGet: {path: /ready, port: metrics}" }}
{{- else if .root.Values.tls.existingSecret }}{{ $check = printf "tcpSocket: {port: %v}" $port }}{{ $ready = $check }}{{ end -}}
{{- /* 5 s to answer, not the kubelet's 1: a Python server busy with a burst answers its health
       check late, and two late readiness answers took a healthy router out of its Service. */}}
startupProbe:
  {{ $check }}
  periodSeconds: {{ .root.Values.startupProbe.periodSeconds }}
  timeoutSeconds: 5
  failureThreshold: {{ .root.Values.startupProbe.failureThreshold }}
readinessProbe:
  {{ $ready }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 2
livenessProbe:
  {{ $check }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* Where every pod mounts the TLS Secret (tls.existingSecret). */}}
{{- define "pdspec.tlsDir" -}}
/etc/pdspec/tls
{{- end -}}

{{/* Where the router's pod mounts the API keys' Secret (apiKeys.existingSecret). */}}
{{- define "pdspec.apiKeyFile" -}}
/etc/pdspec/api-keys/keys
{{- end -}}

{{/* A pod's terminationGracePeriodSeconds from its drain_timeout_s (the context; unset: 30, the
schema's default): the drain plus 15 s to shut down. (Not `default`, which takes a set 0 for unset.) */}}
{{- define "pdspec.terminationGrace" -}}
{{- $drain := . -}}
{{- if kindIs "invalid" $drain }}{{ $drain = 30 }}{{ end -}}
{{- add 15 (ceil $drain) -}}
{{- end -}}

{{/* A pod's nodeSelector, tolerations and affinity from a role's placement (the context). */}}
{{- define "pdspec.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
