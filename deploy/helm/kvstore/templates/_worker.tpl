{{/*
Deployment and Service of a worker (prefill or decode); both run the same
image with a different module. Call with
(dict "root" $ "component" "prefill" "module" "prefill_node" "values" .Values.prefill).
*/}}
{{- define "kvstore.worker" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $name := printf "%s-%s" (include "kvstore.fullname" $root) .component }}
{{- $probe := dict "grpc" (dict "port" (int $v.port)) }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "kvstore.componentLabels" . | nindent 4 }}
spec:
  replicas: {{ $v.replicas }}
  selector:
    matchLabels:
      {{- include "kvstore.componentSelectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kvstore.componentLabels" . | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "kvstore.podCommon" $root | nindent 6 }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      {{- with (include "kvstore.affinity" .) }}{{- . | trim | nindent 6 }}{{- end }}
      {{- with (include "kvstore.scheduling" $v) }}{{- . | trim | nindent 6 }}{{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "kvstore.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command:
            - python
            - -m
            - {{ .module }}
          args:
            - {{ printf "--listen=0.0.0.0:%d" (int $v.port) }}
            - {{ printf "--store=%s" (include "kvstore.worker.storeTarget" .) }}
            - {{ printf "--model=%s" $v.model }}
            {{- with $v.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $redisEnv := "" }}
          {{- if and (not $v.storeTarget) $root.Values.redis.externalUrlSecret.name }}
          {{- $redisEnv = include "kvstore.redis.env" $root }}
          {{- end }}
          {{- if or $redisEnv $v.extraEnv }}
          env:
            {{- with $redisEnv }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
          startupProbe:
            {{- toYaml $probe | nindent 12 }}
            {{- toYaml $v.probes.startup | nindent 12 }}
          readinessProbe:
            {{- toYaml $probe | nindent 12 }}
            {{- toYaml $v.probes.readiness | nindent 12 }}
          livenessProbe:
            {{- toYaml $probe | nindent 12 }}
            {{- toYaml $v.probes.liveness | nindent 12 }}
          {{- with $v.resources }}
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
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- with $v.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "kvstore.componentLabels" . | nindent 4 }}
  {{- with $v.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ $v.service.type }}
  selector:
    {{- include "kvstore.componentSelectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
{{- end }}
