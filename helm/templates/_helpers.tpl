{{/* Names and labels. */}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Object name prefix: at most 40 characters, since KubeRay appends suffixes to the
RayService name (its RayClusters, their pods and services). */}}
{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one Ray group's pods: (dict "root" $ "group" NAME). */}}
{{- define "specserve.groupSelectorLabels" -}}
{{ include "specserve.selectorLabels" .root }}
{{ include "specserve.groupLabels" .group }}
{{- end -}}

{{/* The labels that tell one group's pods from the release's other pods: NAME. */}}
{{- define "specserve.groupLabels" -}}
app.kubernetes.io/component: {{ if eq . "head" }}ray-head{{ else }}ray-worker{{ end }}
specserve/group: {{ . }}
{{- end -}}

{{- define "specserve.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}

{{/* Where the API keys Secret is mounted (a directory: a subPath mount would never see
the Secret's updates). */}}
{{- define "specserve.apiKeysDir" -}}
/etc/specserve/api-keys
{{- end -}}

{{/* The custom Ray resource that pins replicas to one group. */}}
{{- define "specserve.groupResource" -}}
specserve/{{ . }}
{{- end -}}

{{/* Every Ray group (head included) as JSON: name -> {rayCpus, gpus, replicaSlots,
acceleratorType, pods} where pods is the most pods the group can have. */}}
{{- define "specserve.groups" -}}
{{- $groups := dict "head" (dict "rayCpus" .Values.head.rayCpus "gpus" 0 "replicaSlots" .Values.head.replicaSlots "acceleratorType" "" "pods" 1) -}}
{{- range $name, $g := .Values.workerGroups -}}
{{- $pods := ternary $g.maxReplicas $g.replicas $.Values.autoscaling.enabled -}}
{{- $_ := set $groups $name (dict "rayCpus" $g.rayCpus "gpus" $g.gpus "replicaSlots" $g.replicaSlots "acceleratorType" (default "" $g.acceleratorType) "pods" $pods) -}}
{{- end -}}
{{- toJson $groups -}}
{{- end -}}

{{/* The AppConfig passed as the application's args (see values.yaml `app`). */}}
{{- define "specserve.appConfig" -}}
{{- $app := deepCopy .Values.app -}}
{{- range $dep := list "router" "drafter" "target" -}}
{{- $scaling := get (get $app $dep) "scaling" -}}
{{- $group := get $.Values.placement $dep -}}
{{- $_ := set $scaling "resources" (dict (include "specserve.groupResource" $group) 1) -}}
{{- end -}}
{{- if not $app.models.drafter -}}
{{- $_ := set $app.models "drafter" nil -}}
{{- end -}}
{{- $sec := $app.security -}}
{{- $_ := set $sec "api_keys_file" (ternary (printf "%s/%s" (include "specserve.apiKeysDir" .) .Values.apiKeys.secretKey) nil (ne .Values.apiKeys.existingSecret "")) -}}
{{- $_ := set $sec "tls_cert" nil -}}
{{- $_ := set $sec "tls_key" nil -}}
{{- $_ := set $app "redis_url" nil -}}
{{- $_ := set $app "bind_host" nil -}}
{{- $_ := set $app "otlp_endpoint" nil -}}
{{- toJson $app -}}
{{- end -}}

{{/* The Serve config (serveConfigV2) as YAML. */}}
{{- define "specserve.serveConfig" -}}
{{- /* route_prefix "/": the Router's OpenAI-compatible HTTP API answers /v1/... and /health */ -}}
{{- $app := dict "name" "specserve" "import_path" "deployments.app:build_app" "route_prefix" "/" "args" (include "specserve.appConfig" . | fromJson) -}}
{{- /* as deployments/local.py SERVICER_FUNCTIONS: raw request bytes through the proxy */ -}}
{{- $servicers := list "deployments.grpc_raw.add_SpecServeServicer_to_server" "deployments.grpc_raw.add_HealthServicer_to_server" -}}
{{- $cfg := dict "proxy_location" .Values.serve.proxyLocation -}}
{{- $_ := set $cfg "http_options" (dict "host" .Values.serve.http.host "port" .Values.serve.http.port) -}}
{{- $_ := set $cfg "grpc_options" (dict "port" .Values.serve.grpcPort "grpc_servicer_functions" $servicers) -}}
{{- $_ := set $cfg "applications" (list $app) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* rayStartParams of one group: (dict "root" $ "name" NAME "group" VALUES "gpus" N). */}}
{{- define "specserve.rayStartParams" -}}
{{- $res := dict (include "specserve.groupResource" .name) .group.replicaSlots -}}
{{- $p := dict "num-cpus" (toString .group.rayCpus) "num-gpus" (toString .gpus) "metrics-export-port" (toString .root.Values.observability.metrics.port) -}}
{{- /* KubeRay passes `--resources=<value>` through a shell: a quoted JSON string */ -}}
{{- $_ := set $p "resources" (printf "%q" (toJson $res)) -}}
{{- if eq .name "head" -}}
{{- $_ := set $p "dashboard-host" "0.0.0.0" -}}
{{- end -}}
{{- toYaml (merge $p (deepCopy .group.rayStartParams)) -}}
{{- end -}}

{{/* Environment of every Ray container: Redis, OpenTelemetry, extras. */}}
{{- define "specserve.env" -}}
{{- $r := .Values.redis -}}
{{- if eq $r.mode "bundled" }}
- name: REDIS_URL
  value: {{ printf "redis://%s-redis:6379/0" (include "specserve.fullname" .) | quote }}
{{- else if eq $r.mode "external" }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.existingSecret | quote }}
      key: {{ $r.external.secretKey | quote }}
{{- end }}
{{- with .Values.observability.otel }}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ .insecure | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | toString | quote }}
{{- end }}
{{- end }}
{{- $attrs := list (printf "k8s.namespace.name=%s" $.Release.Namespace) (printf "service.namespace=%s" $.Release.Name) }}
{{- range $k, $v := .Values.observability.otel.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $k $v) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ .Values.app.security.max_message_bytes | int64 | toString | quote }}
- name: TOKENIZERS_PARALLELISM
  value: "false"
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The pod template of one Ray group, shared by the head and every worker group:
(dict "root" $ "name" NAME "group" VALUES "gpus" N). */}}
{{- define "specserve.podTemplate" -}}
{{- $root := .root -}}
{{- $head := eq .name "head" -}}
metadata:
  labels:
    {{- /* no chart version here: a changed pod template makes KubeRay build a new cluster */}}
    {{- include "specserve.selectorLabels" $root | nindent 4 }}
    {{- include "specserve.groupLabels" .name | nindent 4 }}
    {{- with $root.Values.commonLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $root.Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ ternary "ray-head" "ray-worker" $head }}
      image: {{ include "specserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      env:
        {{- include "specserve.env" $root | trim | nindent 8 }}
      ports:
        {{- if $head }}
        - name: gcs-server
          containerPort: 6379
        - name: dashboard
          containerPort: 8265
        - name: client
          containerPort: 10001
        - name: grpc
          containerPort: {{ $root.Values.serve.grpcPort }}
        {{- end }}
        - name: serve
          containerPort: {{ $root.Values.serve.http.port }}
        - name: metrics
          containerPort: {{ $root.Values.observability.metrics.port }}
      resources:
        {{- $res := deepCopy .group.resources }}
        {{- if gt (int .gpus) 0 }}
        {{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (toString .gpus)) (default (dict) $res.limits)) }}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      securityContext:
        allowPrivilegeEscalation: false
      volumeMounts:
        - name: shm
          mountPath: /dev/shm
        {{- if $root.Values.apiKeys.existingSecret }}
        - name: api-keys
          mountPath: {{ include "specserve.apiKeysDir" $root }}
          readOnly: true
        {{- end }}
  volumes:
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $root.Values.shmSize }}
    {{- if $root.Values.apiKeys.existingSecret }}
    - name: api-keys
      secret:
        secretName: {{ $root.Values.apiKeys.existingSecret }}
    {{- end }}
  {{- with .group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
