{{/* Chart name, at most 63 characters. */}}
{{- define "propeller.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name of the release's objects: the release name alone when it already contains the chart name. */}}
{{- define "propeller.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "propeller.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "propeller.labels" -}}
helm.sh/chart: {{ include "propeller.chart" . }}
{{ include "propeller.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: propeller
{{- end -}}

{{/* Labels that select the operator's pods; never change them on upgrade. */}}
{{- define "propeller.selectorLabels" -}}
app.kubernetes.io/name: {{ include "propeller.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "propeller.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "propeller.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
Whether the replicas share the objects (active-active, `propeller run --shard`): more than
one replica on an external MQTT cluster, which every replica reaches. With the embedded
broker, extra replicas stay leader-elected standbys.
*/}}
{{- define "propeller.sharded" -}}
{{- if and (gt (int .Values.replicas) 1) .Values.broker.external.addresses -}}
true
{{- end -}}
{{- end -}}

{{/* Fails early on values the operator would reject at start-up. */}}
{{- define "propeller.validate" -}}
{{- if and .Values.scheduler (not (has .Values.scheduler (list "round-robin" "least-loaded" "priority"))) -}}
{{- fail (printf "scheduler must be round-robin, least-loaded or priority, not %q" .Values.scheduler) -}}
{{- end -}}
{{- if not (has .Values.logFormat (list "json" "text")) -}}
{{- fail (printf "logFormat must be json or text, not %q" .Values.logFormat) -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) -}}
{{- fail "tls.enabled needs tls.secretName (a kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- if and .Values.tls.disablePlain (not .Values.tls.enabled) -}}
{{- fail "tls.disablePlain needs tls.enabled, or the broker has no listener" -}}
{{- end -}}
{{- end -}}
