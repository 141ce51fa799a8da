{{/*
Naming, labels and the small computations the templates share.
*/}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "kvstore.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified name prefix for every resource: <release>-<chart>, or just the
release name when it already contains the chart name. Truncated so that the
longest suffix the chart appends ("-store-headless", 15 characters) still
leaves a valid 63-character DNS label.
*/}}
{{- define "kvstore.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "kvstore.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select a release's pods (stable across upgrades). */}}
{{- define "kvstore.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstore.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Standard labels for every resource. */}}
{{- define "kvstore.labels" -}}
helm.sh/chart: {{ include "kvstore.chart" . }}
{{ include "kvstore.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: {{ include "kvstore.name" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Component labels. Call with (dict "root" $ "component" "store").
*/}}
{{- define "kvstore.componentSelectorLabels" -}}
{{ include "kvstore.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvstore.componentLabels" -}}
{{ include "kvstore.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Resource names per component. */}}
{{- define "kvstore.store.fullname" -}}
{{- printf "%s-store" (include "kvstore.fullname" .) }}
{{- end }}

{{- define "kvstore.store.headlessName" -}}
{{- printf "%s-store-headless" (include "kvstore.fullname" .) }}
{{- end }}

{{- define "kvstore.redis.fullname" -}}
{{- printf "%s-redis" (include "kvstore.fullname" .) }}
{{- end }}

{{- define "kvstore.redis.headlessName" -}}
{{- printf "%s-redis-headless" (include "kvstore.fullname" .) }}
{{- end }}

{{/* ServiceAccount used by every kvstore pod. */}}
{{- define "kvstore.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvstore.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The kvstore image reference (store, workers and load test share it). */}}
{{- define "kvstore.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}

{{/*
Size string in the kvstore CLI form (an integer followed by MiB, GiB or TiB)
converted to whole MiB. Fails rendering with a clear message otherwise.
Call with (dict "value" "4GiB" "path" "store.dram").
*/}}
{{- define "kvstore.sizeToMiB" -}}
{{- $s := .value | toString | trim }}
{{- if not (regexMatch "^[1-9][0-9]*(MiB|GiB|TiB)$" $s) }}
{{- fail (printf "%s=%q: sizes must be an integer followed by MiB, GiB or TiB (e.g. 512MiB, 4GiB)" .path $s) }}
{{- end }}
{{- $n := regexReplaceAll "^([0-9]+)(MiB|GiB|TiB)$" $s "${1}" | atoi }}
{{- $unit := regexReplaceAll "^([0-9]+)(MiB|GiB|TiB)$" $s "${2}" }}
{{- if eq $unit "GiB" }}{{ $n = mul $n 1024 }}{{ end }}
{{- if eq $unit "TiB" }}{{ $n = mul $n 1048576 }}{{ end }}
{{- $n }}
{{- end }}

{{/* Whole MiB as a Kubernetes quantity: Gi when it divides evenly, else Mi. */}}
{{- define "kvstore.mibToQuantity" -}}
{{- $mib := . | int64 }}
{{- if and (gt $mib 0) (eq (mod $mib 1024) 0) }}
{{- printf "%dGi" (div $mib 1024) }}
{{- else }}
{{- printf "%dMi" $mib }}
{{- end }}
{{- end }}

{{/*
Store container resources: memory request and limit are DRAM tier plus
store.memoryOverhead (the arena is preallocated, so usage is predictable and
request = limit avoids eviction under memory pressure); CPU from store.cpu.
store.gpu.count adds an nvidia.com/gpu limit. store.resources is merged on
top, so it can override any of it or add other extended resources.
*/}}
{{- define "kvstore.store.resources" -}}
{{- $dram := include "kvstore.sizeToMiB" (dict "value" .Values.store.dram "path" "store.dram") | atoi }}
{{- $overhead := include "kvstore.sizeToMiB" (dict "value" .Values.store.memoryOverhead "path" "store.memoryOverhead") | atoi }}
{{- $memory := include "kvstore.mibToQuantity" (add $dram $overhead) }}
{{- $requests := dict "memory" $memory }}
{{- $limits := dict "memory" $memory }}
{{- with .Values.store.cpu.request }}{{ $_ := set $requests "cpu" (toString .) }}{{ end }}
{{- with .Values.store.cpu.limit }}{{ $_ := set $limits "cpu" (toString .) }}{{ end }}
{{- if gt (int .Values.store.gpu.count) 0 }}{{ $_ := set $limits "nvidia.com/gpu" (int .Values.store.gpu.count) }}{{ end }}
{{- $computed := dict "requests" $requests "limits" $limits }}
{{- toYaml (mustMergeOverwrite $computed (deepCopy .Values.store.resources)) }}
{{- end }}

{{/*
Seconds the store drains in-flight streams after SIGTERM (--drain-seconds):
what is left of terminationGracePeriodSeconds after the preStop sleep, less
10 s for the process to exit, and at least 1.
*/}}
{{- define "kvstore.store.drainSeconds" -}}
{{- $s := .Values.store }}
{{- max 1 (sub (sub (int $s.terminationGracePeriodSeconds) (int $s.preStopSleepSeconds)) 10) }}
{{- end }}

{{/*
True ("true") when the store's bulk TCP lane is rendered (flag, container port,
Service ports): whenever gRPC is plaintext. The lane carries no TLS, and the
store turns it off when it serves gRPC over TLS.
*/}}
{{- define "kvstore.store.tcpLane" -}}
{{- if not .Values.tls.enabled }}true{{ end }}
{{- end }}

{{/*
Size of the NVMe PersistentVolumeClaim: the explicit value, or store.nvme.size
plus 10% (filesystem metadata and room for a compaction segment).
*/}}
{{- define "kvstore.store.nvmeClaimSize" -}}
{{- $pvc := .Values.store.nvme.volume.persistentVolumeClaim }}
{{- if $pvc.size }}
{{- $pvc.size }}
{{- else }}
{{- $mib := include "kvstore.sizeToMiB" (dict "value" .Values.store.nvme.size "path" "store.nvme.size") | atoi }}
{{- include "kvstore.mibToQuantity" (add $mib (div (add $mib 9) 10)) }}
{{- end }}
{{- end }}

{{/*
Redis URL for cluster mode, or "" when no Redis is configured. A URL taken from
a Secret (redis.externalUrlSecret) is not known at render time: callers use
"kvstore.redis.env" and refer to $(KVSTORE_REDIS) instead.
*/}}
{{- define "kvstore.redis.url" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s.%s.svc.%s:%d/%d" (include "kvstore.redis.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.redis.port) (int .Values.redis.database) }}
{{- else if .Values.redis.externalUrl }}
{{- .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/* True ("true") when the store runs in cluster mode (any Redis configured). */}}
{{- define "kvstore.redis.configured" -}}
{{- if or .Values.redis.enabled .Values.redis.externalUrl .Values.redis.externalUrlSecret.name }}true{{ end }}
{{- end }}

{{/* The KVSTORE_REDIS env entry (a list item), or nothing without Redis. */}}
{{- define "kvstore.redis.env" -}}
{{- if .Values.redis.externalUrlSecret.name }}
- name: KVSTORE_REDIS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.externalUrlSecret.name }}
      key: {{ .Values.redis.externalUrlSecret.key }}
{{- else if (include "kvstore.redis.url" .) }}
- name: KVSTORE_REDIS
  value: {{ include "kvstore.redis.url" . | quote }}
{{- end }}
{{- end }}

{{/*
The --store target of the workers: the component's storeTarget when set; in
cluster mode the Redis URL (the client routes by the global index; a URL
from a Secret is referenced as $(KVSTORE_REDIS), which the worker's env
defines); otherwise the store's ClusterIP Service. Call with (dict "root" $ "values" .Values.prefill).
*/}}
{{- define "kvstore.worker.storeTarget" -}}
{{- if .values.storeTarget }}
{{- .values.storeTarget }}
{{- else if (include "kvstore.redis.url" .root) }}
{{- include "kvstore.redis.url" .root }}
{{- else if .root.Values.redis.externalUrlSecret.name }}
{{- "$(KVSTORE_REDIS)" }}
{{- else }}
{{- printf "%s:%d" (include "kvstore.store.fullname" .root) (int .root.Values.store.ports.grpc) }}
{{- end }}
{{- end }}

{{/*
Consistency checks between values that a JSON schema cannot express. Included
once from the store StatefulSet so that a bad combination fails rendering.
*/}}
{{- define "kvstore.validateValues" -}}
{{- if and .Values.redis.enabled (or .Values.redis.externalUrl .Values.redis.externalUrlSecret.name) }}
{{- fail "redis.enabled=true deploys Redis in the chart: set redis.enabled=false to use redis.externalUrl or redis.externalUrlSecret" }}
{{- end }}
{{- if and .Values.redis.externalUrl .Values.redis.externalUrlSecret.name }}
{{- fail "set only one of redis.externalUrl and redis.externalUrlSecret.name" }}
{{- end }}
{{- if and (gt (int .Values.store.replicas) 1) (not (include "kvstore.redis.configured" .)) }}
{{- fail "store.replicas > 1 needs cluster mode: enable redis (redis.enabled=true) or set redis.externalUrl" }}
{{- end }}
{{- $ports := .Values.store.ports }}
{{- if or (eq (int $ports.grpc) (int $ports.metrics)) (eq (int $ports.grpc) (int $ports.tcpLane)) (eq (int $ports.metrics) (int $ports.tcpLane)) }}
{{- fail (printf "store.ports: grpc (%d), metrics (%d) and tcpLane (%d) must be different ports" (int $ports.grpc) (int $ports.metrics) (int $ports.tcpLane)) }}
{{- end }}
{{- if or .Values.store.hbm (gt (float64 .Values.store.hbmFraction) 0.0) }}
{{- $limits := (include "kvstore.store.resources" . | fromYaml).limits | default dict }}
{{- if not (gt (int (index $limits "nvidia.com/gpu" | default 0)) 0) }}
{{- fail "store.hbm and store.hbmFraction put a tier in GPU memory: set store.gpu.count to the GPUs per store pod (at least 1; requested as nvidia.com/gpu)" }}
{{- end }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- fail "tls.enabled=true needs tls.existingSecret: the name of a Secret holding the server certificate and key" }}
{{- end }}
{{- if and .Values.tenants.enabled (not .Values.tenants.existingSecret) }}
{{- fail "tenants.enabled=true needs tenants.existingSecret: the name of a Secret holding the tenants YAML file" }}
{{- end }}
{{- $sm := .Values.metrics.serviceMonitor }}
{{- if and .Values.metrics.tokenSecret.name $sm.enabled $sm.namespace (ne $sm.namespace .Release.Namespace) }}
{{- fail (printf "metrics.tokenSecret.name needs the ServiceMonitor in the release namespace (%s), where the token Secret is: leave metrics.serviceMonitor.namespace empty" .Release.Namespace) }}
{{- end }}
{{- if and .Values.store.pdb.enabled .Values.store.pdb.minAvailable .Values.store.pdb.maxUnavailable }}
{{- fail "set only one of store.pdb.minAvailable and store.pdb.maxUnavailable" }}
{{- end }}
{{- if and .Values.loadtest.enabled (not (and .Values.prefill.enabled .Values.decode.enabled)) }}
{{- fail "loadtest.enabled=true needs prefill.enabled=true and decode.enabled=true: the load test drives both workers" }}
{{- end }}
{{- end }}

{{/* Pod-level fields every kvstore pod shares (service account, pull secrets, security). */}}
{{- define "kvstore.podCommon" -}}
serviceAccountName: {{ include "kvstore.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Scheduling fields shared by every pod spec. Call with the component's values.
*/}}
{{- define "kvstore.scheduling" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Pod anti-affinity between the replicas of one component ("soft" prefers
separate nodes, "hard" requires them, "" adds none), unless the component sets
its own affinity. Call with (dict "root" $ "component" "store" "values" .Values.store).
*/}}
{{- define "kvstore.affinity" -}}
{{- if .values.affinity }}
affinity:
  {{- toYaml .values.affinity | nindent 2 }}
{{- else if eq (toString .values.podAntiAffinity) "soft" }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "kvstore.componentSelectorLabels" . | nindent 14 }}
{{- else if eq (toString .values.podAntiAffinity) "hard" }}
affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "kvstore.componentSelectorLabels" . | nindent 12 }}
{{- end }}
{{- end }}
