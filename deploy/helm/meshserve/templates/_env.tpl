{{/*
Environment of every service: the same MESHSERVE_* names (and ports) that
launcher/mesh.py `service_specs()` passes, plus the cluster-only ones (metrics port,
drain timeout, tracing, pod-IP registration). tests/deploy checks every MESHSERVE_* name
against the service's config dataclass and against the launcher, and every value the default
values give against the dataclass default (test_chart_defaults_are_the_services). Values
come from values.yaml alone: no template restates a default.

Each define takes (dict "root" $ "c" COMPONENT "v" VALUES "port" PORT) and returns a YAML
list; "meshserve.env" then applies the component's `config:` overrides and `extraEnv`.
*/}}

{{- define "meshserve.env.common" -}}
- name: MESHSERVE_HOST
  value: {{ .root.Values.listenHost | quote }}
- name: MESHSERVE_PORT
  value: {{ include "meshserve.scalar" .port | quote }}
{{ include "meshserve.redisUrlEnv" .root }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_LOG_LEVEL" "key" "log-level") }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_TRACING" "key" "tracing") }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_OTLP_ENDPOINT" "key" "otlp-endpoint") }}
- name: MESHSERVE_DRAIN_TIMEOUT_S
  value: {{ include "meshserve.scalar" .v.drainTimeoutSeconds | quote }}
{{- if .c.grpc }}
- name: MESHSERVE_METRICS_PORT
  value: {{ ternary (include "meshserve.scalar" .root.Values.metrics.port) "0" (.root.Values.metrics.enabled | default false) | quote }}
{{- end }}
{{- if .c.model }}
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
{{- if .root.Values.model.hfHome }}
- name: HF_HOME
  value: {{ .root.Values.model.hfHome | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- /*
MESHSERVE_SCHEDULER_ADDRESS of the gateway and the workers is the scheduler Service, one
address whatever scheduler.replicas is (the Service spreads connections over the ready
replicas); the local launcher passes its replicas as a comma-separated list instead.
*/}}
{{- define "meshserve.env.gateway" -}}
{{ include "meshserve.env.common" . }}
- name: MESHSERVE_TOKENIZER_ADDRESS
  value: {{ include "meshserve.address" (dict "root" .root "name" "tokenizer") | quote }}
- name: MESHSERVE_SCHEDULER_ADDRESS
  value: {{ include "meshserve.address" (dict "root" .root "name" "scheduler") | quote }}
# One gateway per pod: its replicas are pods behind the Service, each on its own IP.
- name: MESHSERVE_REUSE_PORT
  value: "false"
{{- if or .root.Values.apiKeys.existingSecret .root.Values.apiKeys.keys }}
- name: MESHSERVE_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "meshserve.apiKeysSecretName" .root }}
      key: {{ .root.Values.apiKeys.secretKey }}
{{- else }}
- name: MESHSERVE_API_KEYS
  value: ""
{{- end }}
{{- $lora := .root.Values.lora }}
- name: MESHSERVE_ENABLE_LORA_UPDATING
  value: {{ and $lora.enabled $lora.runtimeUpdating | toString | quote }}
{{- if and $lora.enabled $lora.adminApiKeys.existingSecret }}
- name: MESHSERVE_ADMIN_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ $lora.adminApiKeys.existingSecret }}
      key: {{ $lora.adminApiKeys.secretKey }}
{{- else }}
- name: MESHSERVE_ADMIN_API_KEYS
  value: ""
{{- end }}
{{- end }}

{{- define "meshserve.env.tokenizer" -}}
{{ include "meshserve.env.common" . }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_MODEL_DIR" "key" "model-dir") }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_SERVED_MODEL_NAME" "key" "served-model-name") }}
{{- end }}

{{- define "meshserve.env.scheduler" -}}
{{ include "meshserve.env.common" . }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_ROUTING_POLICY" "key" "routing-policy") }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_BLOCK_SIZE" "key" "block-size") }}
{{- if and .root.Values.encoder.enabled .root.Values.encoderCache.enabled }}
- name: MESHSERVE_ENCODER_CACHE_ADDRESS
  value: {{ include "meshserve.address" (dict "root" .root "name" "encoder-cache") | quote }}
{{- end }}
{{- end }}

{{- define "meshserve.env.encoder-cache" -}}
- name: POD_NAME
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
- name: POD_IP
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{ include "meshserve.env.common" . }}
- name: MESHSERVE_ADVERTISE_ADDRESS
  value: {{ printf "$(POD_IP):%s" (include "meshserve.scalar" .port) | quote }}
- name: MESHSERVE_SHARD_ID
  value: "$(POD_NAME)"
- name: MESHSERVE_CAPACITY_MB
  value: {{ include "meshserve.scalar" .v.capacityMb | quote }}
{{- end }}

{{/* Shared by the three worker roles. */}}
{{- define "meshserve.env.worker" -}}
{{- $gpu := gt (int64 (.v.gpus | default 0)) 0 }}
- name: POD_NAME
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
- name: POD_IP
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{ include "meshserve.env.common" . }}
- name: MESHSERVE_ROLE
  value: {{ .c.name | quote }}
- name: MESHSERVE_WORKER_ID
  value: "$(POD_NAME)"
- name: MESHSERVE_ADVERTISE_ADDRESS
  value: {{ printf "$(POD_IP):%s" (include "meshserve.scalar" .port) | quote }}
- name: MESHSERVE_SCHEDULER_ADDRESS
  value: {{ include "meshserve.address" (dict "root" .root "name" "scheduler") | quote }}
- name: MESHSERVE_DEVICE
  value: {{ .v.device | default (ternary "cuda" "cpu" $gpu) | quote }}
- name: MESHSERVE_DTYPE
  value: {{ .v.dtype | default "auto" | quote }}
{{- if eq (toString (.v.numThreads | default "auto")) "auto" }}
- name: MESHSERVE_NUM_THREADS
  valueFrom:
    resourceFieldRef:
      containerName: {{ .c.name }}
      resource: limits.cpu
      divisor: "1"
{{- else }}
- name: MESHSERVE_NUM_THREADS
  value: {{ include "meshserve.scalar" .v.numThreads | quote }}
{{- end }}
{{- end }}

{{- define "meshserve.env.decoder" -}}
{{ include "meshserve.env.worker" . }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_MODEL_DIR" "key" "model-dir") }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_SERVED_MODEL_NAME" "key" "served-model-name") }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_BLOCK_SIZE" "key" "block-size") }}
- name: MESHSERVE_KV_CACHE_MEMORY_MB
  value: {{ include "meshserve.scalar" .v.kvCacheMemoryMb | quote }}
- name: MESHSERVE_MAX_NUM_SEQS
  value: {{ include "meshserve.scalar" .v.maxNumSeqs | quote }}
{{- if .v.kvTierMb }}
- name: MESHSERVE_KV_TIER_MB
  value: {{ include "meshserve.scalar" .v.kvTierMb | quote }}
{{- end }}
- name: MESHSERVE_STREAM_INTERVAL
  value: {{ include "meshserve.scalar" .v.streamInterval | quote }}
- name: MESHSERVE_GENERATION_CONFIG
  value: {{ .v.generationConfig | quote }}
{{- if and .root.Values.encoder.enabled .root.Values.encoderCache.enabled }}
- name: MESHSERVE_ENCODER_CACHE_ADDRESS
  value: {{ include "meshserve.address" (dict "root" .root "name" "encoder-cache") | quote }}
{{- end }}
{{- with .root.Values.lora }}
{{- if .enabled }}
{{- $modules := list }}
{{- range $name, $path := .modules }}{{ $modules = append $modules (printf "%s=%s" $name $path) }}{{ end }}
- name: MESHSERVE_MAX_LORAS
  value: {{ include "meshserve.scalar" .maxLoras | quote }}
- name: MESHSERVE_MAX_LORA_RANK
  value: {{ include "meshserve.scalar" .maxLoraRank | quote }}
- name: MESHSERVE_MAX_CPU_LORAS
  value: {{ include "meshserve.scalar" .maxCpuLoras | quote }}
- name: MESHSERVE_LORA_MODULES
  value: {{ join "," $modules | quote }}
- name: MESHSERVE_ENABLE_RUNTIME_LORA_UPDATING
  value: {{ .runtimeUpdating | toString | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- /* A prefill worker runs the decoder's engine (same model, KV cache, block size: the
scheduler pairs it only with decoders of an equal KV layout). */}}
{{- define "meshserve.env.prefill" -}}
{{ include "meshserve.env.decoder" . }}
{{- end }}

{{- define "meshserve.env.embedding" -}}
{{ include "meshserve.env.worker" . }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_MODEL_DIR" "key" "embedding-model-dir") }}
{{- if .root.Values.embeddingModel.servedModelName }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_SERVED_MODEL_NAME" "key" "embedding-served-model-name") }}
{{- end }}
{{- end }}

{{- define "meshserve.env.encoder" -}}
{{ include "meshserve.env.worker" . }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_MODEL_DIR" "key" "model-dir") }}
{{ include "meshserve.configEnv" (dict "root" .root "env" "MESHSERVE_SERVED_MODEL_NAME" "key" "served-model-name") }}
{{- if .root.Values.encoderCache.enabled }}
- name: MESHSERVE_ENCODER_CACHE_ADDRESS
  value: {{ include "meshserve.address" (dict "root" .root "name" "encoder-cache") | quote }}
{{- end }}
{{- end }}

{{/*
The container env of a component: its base list, then `config:` (field → MESHSERVE_FIELD,
replacing a base entry of the same name), then the global and the component's extraEnv.
*/}}
{{- define "meshserve.env" -}}
{{- $base := include (printf "meshserve.env.%s" .c.name) . | fromYamlArray }}
{{- $override := dict }}
{{- range $field, $value := (.v.config | default dict) }}
{{- $_ := set $override (printf "MESHSERVE_%s" (upper $field)) (include "meshserve.scalar" $value) }}
{{- end }}
{{- $out := list }}
{{- range $base }}
{{- if not (hasKey $override .name) }}{{ $out = append $out . }}{{ end }}
{{- end }}
{{- range $name := (keys $override | sortAlpha) }}
{{- $out = append $out (dict "name" $name "value" (get $override $name)) }}
{{- end }}
{{- $out = concat $out (.root.Values.extraEnv | default list) (.v.extraEnv | default list) }}
{{- toYaml $out }}
{{- end }}
