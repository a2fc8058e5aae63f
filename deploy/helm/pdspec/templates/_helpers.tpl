{{/* Names and labels shared by every template. */}}

{{- define "pdspec.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
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

{{/* Checks that the schema cannot express because they are about running in pods. */}}
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
kubelet checks no certificate, the API asks none), and the other probes check that the port
accepts connections (tcpSocket; see values.yaml). */}}
{{- define "pdspec.probes" -}}
{{- $port := .port -}}
{{- $check := printf "grpc: {port: %v}" $port -}}
{{- $ready := $check -}}
{{- if .readyService }}{{ $ready = printf "grpc: {port: %v, service: %s}" $port .readyService }}{{ end -}}
{{- if and .root.Values.tls.existingSecret .httpPort }}
{{- $check = "httpGet: {path: /health, port: http, scheme: HTTPS}" }}{{ $ready = "httpGet: {path: /ready, port: http, scheme: HTTPS}" }}
{{- else if .root.Values.tls.existingSecret }}{{ $check = printf "tcpSocket: {port: %v}" $port }}{{ $ready = $check }}{{ end -}}
startupProbe:
  {{ $check }}
  periodSeconds: {{ .root.Values.startupProbe.periodSeconds }}
  failureThreshold: {{ .root.Values.startupProbe.failureThreshold }}
readinessProbe:
  {{ $ready }}
  periodSeconds: 5
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
