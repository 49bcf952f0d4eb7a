{{- define "loopwarden.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loopwarden.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The pods' ServiceAccount: the chart's (named as its other objects unless
`serviceAccount.name`), or an existing one, by default the namespace's "default". */}}
{{- define "loopwarden.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "loopwarden.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "loopwarden.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loopwarden.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end -}}

{{- define "loopwarden.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "loopwarden.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* "true" when more than one pod may serve at once. */}}
{{- define "loopwarden.manyPods" -}}
{{- if or .Values.autoscaling.enabled (gt (int .Values.replicaCount) 1) -}}true{{- end -}}
{{- end -}}

{{/* Thread counts and stored contexts must be shared by every pod: only redis is. */}}
{{- define "loopwarden.checkState" -}}
{{- $backend := dig "state" "backend" "sqlite" .Values.config -}}
{{- if and (include "loopwarden.manyPods" .) (ne $backend "redis") -}}
{{- fail (printf "config.state.backend: must be redis when more than one pod serves (replicaCount or autoscaling), so that thread counts and stored contexts are shared; it is %s" $backend) -}}
{{- end -}}
{{- if and .Values.persistence.enabled (include "loopwarden.manyPods" .) -}}
{{- fail "persistence.enabled: one claim is for one pod's sqlite file; several pods share redis instead" -}}
{{- end -}}
{{- if and (gt (int .Values.workers) 1) (eq $backend "memory") -}}
{{- fail "config.state.backend: memory is per process: with workers above 1, use sqlite or redis" -}}
{{- end -}}
{{- end -}}

{{/* A /metrics that needs a key is scraped with one. */}}
{{- define "loopwarden.checkScrape" -}}
{{- if dig "auth" "metrics_key" false .Values.config -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.serviceMonitor.authorization) -}}
{{- fail "metrics.serviceMonitor.authorization: config.auth.metrics_key is true: the ServiceMonitor needs a key that may read /metrics (a Secret's, under credentials)" -}}
{{- end -}}
{{- if and .Values.metrics.podAnnotations (not .Values.metrics.serviceMonitor.enabled) -}}
{{- fail "metrics.podAnnotations: config.auth.metrics_key is true, and annotations cannot carry a key: turn them off, and scrape with the ServiceMonitor and its authorization" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The port the container listens on: the Service's, or 8080 for a Service below 1024 (the
container has no root and no capabilities to bind one). */}}
{{- define "loopwarden.containerPort" -}}
{{- if .Values.service.containerPort -}}{{ .Values.service.containerPort }}
{{- else if lt (int .Values.service.port) 1024 -}}8080
{{- else -}}{{ .Values.service.port }}
{{- end -}}
{{- end -}}

{{/* The autoscaler's bounds in order. */}}
{{- define "loopwarden.checkAutoscaling" -}}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- fail (printf "autoscaling.minReplicas: %d is above autoscaling.maxReplicas (%d)" (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- end -}}

{{/* The probes' listener is a port of its own. */}}
{{- define "loopwarden.checkPorts" -}}
{{- if eq (int (include "loopwarden.containerPort" .)) (int .Values.service.probePort) -}}
{{- fail (printf "service.probePort: must differ from the port the container listens on (%d): the probes and scrapes have a listener of their own" (int (include "loopwarden.containerPort" .))) -}}
{{- end -}}
{{- end -}}

{{/* The pod's grace period: the preStop delay, the server's drain and the 5 s the runs it
stops get to let go of their locks, plus 5 s to exit; one set must hold the first three. */}}
{{- define "loopwarden.gracePeriod" -}}
{{- $drain := int (ceil (include "loopwarden.setting" (list .Values.config "server" "shutdown_timeout_s" 30))) -}}
{{- $needed := add .Values.shutdownDelaySeconds $drain 5 -}}
{{- $set := .Values.terminationGracePeriodSeconds -}}
{{- if kindIs "invalid" $set -}}{{ add $needed 5 }}
{{- else if lt (int64 $set) (int64 $needed) -}}
{{- fail (printf "terminationGracePeriodSeconds: %d is less than shutdownDelaySeconds, config.server.shutdown_timeout_s and the 5 s the runs they stop get to let go, together (%d): runs would be killed, not answered" (int64 $set) (int64 $needed)) -}}
{{- else -}}{{ int64 $set }}
{{- end -}}
{{- end -}}

{{/* A setting of the config's section (list config section name default): the default when
the section or the setting is missing or null. */}}
{{- define "loopwarden.setting" -}}
{{- $section := index . 0 | default dict -}}
{{- $values := get $section (index . 1) | default dict -}}
{{- $value := index $values (index . 2) -}}
{{- if kindIs "invalid" $value -}}{{ index . 3 }}{{- else -}}{{ $value }}{{- end -}}
{{- end -}}
