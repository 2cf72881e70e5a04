{{/*
Names and labels.
*/}}
{{- define "meshserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "meshserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "meshserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "meshserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "meshserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "meshserve.labels" -}}
helm.sh/chart: {{ include "meshserve.chart" . }}
{{ include "meshserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: meshserve
{{- end }}

{{/* (dict "root" $ "name" "gateway") */}}
{{- define "meshserve.componentSelectorLabels" -}}
{{ include "meshserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .name }}
{{- end }}

{{- define "meshserve.componentLabels" -}}
{{ include "meshserve.labels" .root }}
app.kubernetes.io/component: {{ .name }}
{{- end }}

{{/* Object name of a component: RELEASE-meshserve-gateway, ... (dict "root" $ "name" "gateway") */}}
{{- define "meshserve.componentFullname" -}}
{{- printf "%s-%s" (include "meshserve.fullname" .root | trunc 45 | trimSuffix "-") .name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "meshserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "meshserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "meshserve.configMapName" -}}
{{- printf "%s-config" (include "meshserve.fullname" .) }}
{{- end }}

{{- define "meshserve.apiKeysSecretName" -}}
{{- if .Values.apiKeys.existingSecret }}
{{- .Values.apiKeys.existingSecret }}
{{- else }}
{{- printf "%s-api-keys" (include "meshserve.fullname" .) }}
{{- end }}
{{- end }}

{{/*
The services of the mesh. `name` is the component (as in launcher/mesh.py service
names and DEFAULT_PORTS), `key` its block in values.yaml and in .Values.ports, `module` the
`python -m` entry point. grpc: serves grpc.health.v1 (else HTTP /health). worker: a model
worker (startup probe, headless Service, pod-IP registration). model: mounts the model volume.
*/}}
{{- define "meshserve.components" -}}
- {name: gateway, key: gateway, module: gateway, grpc: false, worker: false, model: false}
- {name: tokenizer, key: tokenizer, module: tokenizer_svc, grpc: true, worker: false, model: true}
- {name: scheduler, key: scheduler, module: scheduler_svc, grpc: true, worker: false, model: false}
- {name: encoder-cache, key: encoderCache, module: encoder_cache_svc, grpc: true, worker: false, model: false}
- {name: decoder, key: decoder, module: worker_svc, grpc: true, worker: true, model: true}
- {name: embedding, key: embedding, module: worker_svc, grpc: true, worker: true, model: true}
- {name: encoder, key: encoder, module: worker_svc, grpc: true, worker: true, model: true}
- {name: prefill, key: prefill, module: worker_svc, grpc: true, worker: true, model: true}
{{- end }}

{{/* One component's metadata by name: (dict "root" $ "name" "decoder") → YAML map */}}
{{- define "meshserve.component" -}}
{{- $want := .name }}
{{- range (include "meshserve.components" .root | fromYamlArray) }}
{{- if eq .name $want }}{{ toYaml . }}{{ end }}
{{- end }}
{{- end }}

{{/* gRPC/HTTP address of a component's Service: (dict "root" $ "name" "scheduler") */}}
{{- define "meshserve.address" -}}
{{- $c := include "meshserve.component" . | fromYaml }}
{{- printf "%s:%v" (include "meshserve.componentFullname" .) (include "meshserve.scalar" (index .root.Values.ports $c.key)) }}
{{- end }}

{{/*
A scalar as an env string: whole numbers without exponent (Helm reads YAML numbers as
float64: 1000000 would otherwise print as 1e+06), lists joined with commas.
*/}}
{{- define "meshserve.scalar" -}}
{{- $v := . }}
{{- if kindIs "float64" $v }}
{{- if eq $v (floor $v) }}{{ int64 $v }}{{ else }}{{ $v }}{{ end }}
{{- else if kindIs "slice" $v }}
{{- $parts := list }}
{{- range $v }}{{ $parts = append $parts (include "meshserve.scalar" .) }}{{ end }}
{{- join "," $parts }}
{{- else if kindIs "invalid" $v }}
{{- else }}
{{- $v }}
{{- end }}
{{- end }}

{{/* image reference: (dict "root" $ "values" $componentValues) */}}
{{- define "meshserve.image" -}}
{{- $img := merge (deepCopy (.values.image | default dict)) .root.Values.image }}
{{- printf "%s:%s" $img.repository (toString (default .root.Chart.AppVersion $img.tag)) }}
{{- end }}

{{- define "meshserve.imagePullPolicy" -}}
{{- $img := merge (deepCopy (.values.image | default dict)) .root.Values.image }}
{{- $img.pullPolicy | default "IfNotPresent" }}
{{- end }}

{{/* MESHSERVE_DRAIN_TIMEOUT_S rounded up to whole seconds */}}
{{- define "meshserve.drainSeconds" -}}
{{- int64 (ceil (float64 .drainTimeoutSeconds)) }}
{{- end }}

{{/* env entry for MESHSERVE_REDIS_URL */}}
{{- define "meshserve.redisUrlEnv" -}}
- name: MESHSERVE_REDIS_URL
{{- if and (not .Values.redis.enabled) .Values.redis.existingSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret.name }}
      key: {{ .Values.redis.existingSecret.key }}
{{- else }}
  valueFrom:
    configMapKeyRef:
      name: {{ include "meshserve.configMapName" . }}
      key: redis-url
{{- end }}
{{- end }}

{{/* "true" when the services get a Redis (bundled, URL or Secret), "" otherwise */}}
{{- define "meshserve.redisConfigured" -}}
{{- if or .Values.redis.enabled .Values.redis.url .Values.redis.existingSecret.name }}true{{ end }}
{{- end }}

{{- define "meshserve.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:6379/0" (include "meshserve.componentFullname" (dict "root" . "name" "redis")) }}
{{- else }}
{{- .Values.redis.url }}
{{- end }}
{{- end }}

{{/* env entry reading a key of the chart's ConfigMap: (dict "root" $ "env" NAME "key" KEY) */}}
{{- define "meshserve.configEnv" -}}
- name: {{ .env }}
  valueFrom:
    configMapKeyRef:
      name: {{ include "meshserve.configMapName" .root }}
      key: {{ .key }}
{{- end }}
