{{/*
Shared names, labels and small builders for the pagoda chart.
*/}}

{{- define "pagoda.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped prefix of every object name; short enough for "-worker-<group>-<hash>" pod names. */}}
{{- define "pagoda.fullname" -}}
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

{{/* Selector labels: stable for the life of a release, so they never change on upgrade. */}}
{{- define "pagoda.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagoda.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .group }}
pagoda.io/worker-group: {{ .group }}
{{- end }}
{{- end -}}

{{- define "pagoda.labels" -}}
{{ include "pagoda.selectorLabels" . }}
app.kubernetes.io/part-of: pagoda
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "pagoda.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* A number as the CLI expects it: integral floats (JSON numbers) without an exponent. */}}
{{- define "pagoda.scalar" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/*
Flags as a ConfigMap: .flags is a list of [flag, value] pairs (nil values are left out). "data"
renders the ConfigMap data, "args" the container args that read it back through $(VAR)
expansion, so the ConfigMap is the one place the settings live and its checksum rolls the pods.
*/}}
{{- define "pagoda.flagEnvName" -}}
{{- printf "PAGODA_FLAG_%s" (. | trimPrefix "--" | upper | replace "-" "_") -}}
{{- end -}}

{{- define "pagoda.flagData" -}}
{{- range .flags }}
{{- if not (kindIs "invalid" (index . 1)) }}
{{ include "pagoda.flagEnvName" (index . 0) }}: {{ include "pagoda.scalar" (index . 1) | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pagoda.flagArgs" -}}
{{- range .flags }}
{{- if not (kindIs "invalid" (index . 1)) }}
- {{ index . 0 | quote }}
- {{ printf "$(%s)" (include "pagoda.flagEnvName" (index . 0)) | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pagoda.redisUrl" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- printf "redis://%s-redis:%d/0" (include "pagoda.fullname" .) (int64 .Values.redis.bundled.port) -}}
{{- else -}}
{{- required "redis.url: required when redis.mode is external" .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/* Env shared by router and worker containers: secrets by reference only, writable HOME. */}}
{{- define "pagoda.commonEnv" -}}
- name: HOME
  value: /tmp
{{- with .Values.redis.passwordSecret }}
{{- if .name }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pagoda.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ int64 .Values.securityContext.runAsUser }}
runAsGroup: {{ int64 .Values.securityContext.runAsGroup }}
fsGroup: {{ int64 .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "pagoda.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Native gRPC probes (grpc.health.v1) need a numeric port: named ports are not allowed there.
Kubelet gRPC probes cannot speak TLS: with .tls they check the port with tcpSocket instead. */}}
{{- define "pagoda.grpcProbes" -}}
{{- $check := ternary (dict "tcpSocket" (dict "port" (int64 .port))) (dict "grpc" (dict "port" (int64 .port))) (not (empty .tls)) }}
{{- range $name, $key := dict "startupProbe" "startup" "livenessProbe" "liveness" "readinessProbe" "readiness" }}
{{- $p := index $.probes $key }}
{{ $name }}:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: {{ int64 $p.periodSeconds }}
  failureThreshold: {{ int64 $p.failureThreshold }}
  timeoutSeconds: {{ int64 (default 1 $p.timeoutSeconds) }}
{{- end }}
{{- end -}}

{{- define "pagoda.topologySpread" -}}
{{- if .spread.enabled }}
topologySpreadConstraints:
  - maxSkew: {{ int64 .spread.maxSkew }}
    topologyKey: {{ .spread.topologyKey }}
    whenUnsatisfiable: {{ .spread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "pagoda.selectorLabels" . | nindent 8 }}
{{- end }}
{{- end -}}

{{/* Worker groups with workerDefaults applied: a group's top-level key replaces the default's. */}}
{{- define "pagoda.checkWorkers" -}}
{{- $seen := dict -}}
{{- range $i, $group := .Values.workers -}}
{{- if hasKey $seen $group.name -}}
{{- fail (printf "workers[%d].name: %q is used by two groups" $i $group.name) -}}
{{- end -}}
{{- $_ := set $seen $group.name true -}}
{{- end -}}
{{- end -}}
