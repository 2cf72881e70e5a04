{{/*
Deployment + Service of one meshserve component: (dict "root" $ "name" "decoder").
*/}}
{{- define "meshserve.workload" -}}
{{- $root := .root }}
{{- $c := include "meshserve.component" . | fromYaml }}
{{- $v := index $root.Values $c.key }}
{{- if $v.enabled }}
{{- $name := include "meshserve.componentFullname" . }}
{{- $port := index $root.Values.ports $c.key }}
{{- $ctx := dict "root" $root "c" $c "v" $v "port" $port }}
{{- $drain := int64 (include "meshserve.drainSeconds" $v) }}
{{- $preStop := int64 ($root.Values.preStopSleepSeconds | default 0) }}
{{- $live := $root.Values.probes.liveness }}
{{- $ready := $root.Values.probes.readiness }}
{{- $startup := $v.startupProbe | default dict }}
{{- $livePeriod := int64 ($live.periodSeconds | default 10) }}
{{- /* Liveness must survive a whole drain (health is NOT_SERVING while draining). */}}
{{- $liveFailures := max (int64 ($live.failureThreshold | default 3)) (add1 (div (add $drain $preStop $livePeriod -1) $livePeriod)) }}
{{- $gpus := int64 ($v.gpus | default 0) }}
{{- $resources := deepCopy ($v.resources | default dict) }}
{{- if gt $gpus 0 }}
{{- $limits := $resources.limits | default dict }}
{{- $_ := set $limits "nvidia.com/gpu" $gpus }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- $metricsOn := and $c.grpc $root.Values.metrics.enabled }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "meshserve.componentLabels" . | nindent 4 }}
spec:
  {{- if not (and $v.autoscaling $v.autoscaling.enabled) }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- with $v.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "meshserve.componentSelectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "meshserve.componentLabels" . | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        {{- if and $root.Values.metrics.enabled $root.Values.metrics.podAnnotations }}
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ include "meshserve.scalar" (ternary $root.Values.metrics.port $port $c.grpc) | quote }}
        prometheus.io/path: /metrics
        {{- end }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "meshserve.serviceAccountName" $root }}
      automountServiceAccountToken: false
      # No {SERVICE}_PORT/_HOST env per Service: with release "meshserve" they would be
      # MESHSERVE_* names, the services' configuration namespace.
      enableServiceLinks: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $v.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      # SIGTERM arrives after the preStop sleep; the service then drains for up to
      # MESHSERVE_DRAIN_TIMEOUT_S. The grace period covers both plus a margin.
      terminationGracePeriodSeconds: {{ add $preStop $drain (int64 ($root.Values.terminationGraceMarginSeconds | default 15)) }}
      containers:
        - name: {{ $c.name }}
          image: {{ include "meshserve.image" (dict "root" $root "values" $v) | quote }}
          imagePullPolicy: {{ include "meshserve.imagePullPolicy" (dict "root" $root "values" $v) }}
          command: ["python", "-m", {{ $c.module | quote }}]
          {{- with $v.args }}
          args:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            - name: {{ ternary "grpc" "http" $c.grpc }}
              containerPort: {{ include "meshserve.scalar" $port }}
              protocol: TCP
            {{- if $metricsOn }}
            - name: metrics
              containerPort: {{ include "meshserve.scalar" $root.Values.metrics.port }}
              protocol: TCP
            {{- end }}
          env:
            {{- include "meshserve.env" $ctx | nindent 12 }}
          # Liveness and readiness start once this passes: model load for workers, imports
          # and connections for the others (a slow start is not killed by liveness).
          startupProbe:
            {{- if $c.grpc }}
            grpc:
              port: {{ include "meshserve.scalar" $port }}
            {{- else }}
            tcpSocket:
              port: http
            {{- end }}
            periodSeconds: {{ include "meshserve.scalar" ($startup.periodSeconds | default 5) }}
            timeoutSeconds: {{ include "meshserve.scalar" ($ready.timeoutSeconds | default 2) }}
            failureThreshold: {{ include "meshserve.scalar" ($startup.failureThreshold | default 120) }}
          readinessProbe:
            {{- if $c.grpc }}
            grpc:
              port: {{ include "meshserve.scalar" $port }}
            {{- else }}
            # /health is "ok" only when the tokenizer, the scheduler and a decoder are ready.
            httpGet:
              path: /health
              port: http
            {{- end }}
            periodSeconds: {{ include "meshserve.scalar" ($ready.periodSeconds | default 5) }}
            timeoutSeconds: {{ include "meshserve.scalar" ($ready.timeoutSeconds | default 2) }}
            failureThreshold: {{ include "meshserve.scalar" ($ready.failureThreshold | default 3) }}
          livenessProbe:
            {{- if $c.grpc }}
            grpc:
              port: {{ include "meshserve.scalar" $port }}
            {{- else }}
            # Not /health: it reports upstream readiness, and a gateway must not be restarted
            # because a worker is down.
            tcpSocket:
              port: http
            {{- end }}
            periodSeconds: {{ $livePeriod }}
            timeoutSeconds: {{ include "meshserve.scalar" ($live.timeoutSeconds | default 5) }}
            failureThreshold: {{ $liveFailures }}
          lifecycle:
            preStop:
              exec:
                command: ["sleep", "{{ $preStop }}"]
          {{- with $resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: cache
              mountPath: /home/meshserve/.cache
            {{- if $c.worker }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
            {{- if and $c.model $root.Values.model.volume }}
            - name: model
              mountPath: {{ $root.Values.model.mountPath }}
              readOnly: true
            {{- end }}
            {{- if and (eq $c.name "decoder") $root.Values.lora.enabled $root.Values.lora.volume }}
            - name: lora-adapters
              mountPath: {{ $root.Values.lora.mountPath }}
              readOnly: true
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        - name: cache
          emptyDir: {}
        {{- if $c.worker }}
        - name: dshm
          emptyDir:
            medium: Memory
            {{- with $v.shmSize }}
            sizeLimit: {{ . }}
            {{- end }}
        {{- end }}
        {{- if and $c.model $root.Values.model.volume }}
        - name: model
          {{- toYaml $root.Values.model.volume | nindent 10 }}
        {{- end }}
        {{- if and (eq $c.name "decoder") $root.Values.lora.enabled $root.Values.lora.volume }}
        - name: lora-adapters
          {{- toYaml $root.Values.lora.volume | nindent 10 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "meshserve.componentLabels" . | nindent 4 }}
  {{- with ($v.service | default dict).annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if $c.worker }}
  # Headless: the scheduler dials each worker at the pod IP it registered with; the Service
  # gives DNS (one A record per ready pod) and a target for monitoring.
  clusterIP: None
  {{- else }}
  type: {{ ($v.service | default dict).type | default "ClusterIP" }}
  {{- end }}
  selector:
    {{- include "meshserve.componentSelectorLabels" . | nindent 4 }}
  ports:
    - name: {{ ternary "grpc" "http" $c.grpc }}
      port: {{ include "meshserve.scalar" $port }}
      targetPort: {{ ternary "grpc" "http" $c.grpc }}
      protocol: TCP
      {{- if $c.grpc }}
      appProtocol: grpc
      {{- else }}
      appProtocol: http
      {{- end }}
    {{- if $metricsOn }}
    - name: metrics
      port: {{ include "meshserve.scalar" $root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
    {{- end }}
{{- end }}
{{- end }}
