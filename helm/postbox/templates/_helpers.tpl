{{/* Chart name, truncated to the 63 characters Kubernetes allows. */}}
{{- define "postbox.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name. */}}
{{- define "postbox.fullname" -}}
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

{{- define "postbox.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "postbox.labels" -}}
helm.sh/chart: {{ include "postbox.chart" . }}
{{ include "postbox.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "postbox.selectorLabels" -}}
app.kubernetes.io/name: {{ include "postbox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "postbox.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "postbox.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "postbox.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret holding DATABASE_URL: the user's, or the chart's. */}}
{{- define "postbox.databaseSecretName" -}}
{{- if .Values.database.existingSecret }}
{{- .Values.database.existingSecret }}
{{- else }}
{{- include "postbox.fullname" . }}
{{- end }}
{{- end }}

{{- define "postbox.databaseSecretKey" -}}
{{- if .Values.database.existingSecret }}
{{- .Values.database.existingSecretKey }}
{{- else }}
{{- "DATABASE_URL" }}
{{- end }}
{{- end }}

{{/* POSTBOX_KAFKA_PROPERTY_<NAME>: librdkafka property `a.b.c` from env A_B_C. */}}
{{- define "postbox.kafkaSecretEnv" -}}
{{- if .Values.config.kafka.enabled }}
{{- range $prop, $ref := .Values.config.kafka.secretProperties }}
- name: POSTBOX_KAFKA_PROPERTY_{{ $prop | replace "." "_" | upper }}
  valueFrom:
    secretKeyRef:
      name: {{ $ref.secretName }}
      key: {{ $ref.key }}
{{- end }}
{{- end }}
{{- end }}

{{/* The relay configuration file (TOML). The database URL comes from the environment. */}}
{{- define "postbox.config" -}}
# Rendered by the postbox Helm chart; DATABASE_URL comes from a Secret.
[relay]
batch_size = {{ .Values.config.relay.batchSize | int }}
concurrency = {{ .Values.config.relay.concurrency | int }}
lease = {{ .Values.config.relay.lease | quote }}
poll_interval = {{ .Values.config.relay.pollInterval | quote }}
shutdown_deadline = {{ .Values.config.relay.shutdownDeadline | quote }}
delivery_timeout = {{ .Values.config.relay.deliveryTimeout | quote }}
hold_limit = {{ .Values.config.relay.holdLimit | quote }}
payload_budget = {{ .Values.config.relay.payloadBudget | quote }}
{{- with .Values.config.relay.topicTimeouts }}
{{- $first := true }}
topic_timeouts = { {{- range $pattern, $timeout := . }}{{ if not $first }},{{ end }} {{ $pattern | quote }} = {{ $timeout | quote }}{{ $first = false }}{{- end }} }
{{- end }}

{{- with .Values.config.retention.keepCompleted }}

[retention]
keep_completed = {{ . | quote }}
{{- end }}
{{- with .Values.config.stream }}
{{- if .enabled }}

[stream]
slot = {{ .slot | quote }}
publication = {{ .publication | quote }}
create_slot = {{ .createSlot }}
status_interval = {{ .statusInterval | quote }}
batch_size = {{ .batchSize | int }}
takeover_interval = {{ .takeoverInterval | quote }}
liveness_interval = {{ .livenessInterval | quote }}
{{- end }}
{{- end }}

{{- if .Values.ui.enabled }}

[ui]
enabled = true
listen = "0.0.0.0:{{ .Values.ui.port | int }}"
path_prefix = {{ .Values.ui.pathPrefix | quote }}
actions = {{ .Values.ui.actions }}
show_payloads = {{ .Values.ui.showPayloads }}
{{- with .Values.ui.allowedHosts }}
allowed_hosts = [{{ range $i, $h := . }}{{ if $i }}, {{ end }}{{ $h | quote }}{{ end }}]
{{- end }}
{{- end }}

[metrics]
listen = "0.0.0.0:{{ .Values.config.metrics.port | int }}"
sample_interval = {{ .Values.config.metrics.sampleInterval | quote }}
max_topics = {{ .Values.config.metrics.maxTopics | int }}
{{- if .Values.config.kafka.enabled }}

[sinks.kafka]
brokers = {{ .Values.config.kafka.brokers | quote }}

[sinks.kafka.properties]
{{- range $k, $v := .Values.config.kafka.properties }}
{{- if regexMatch "(?i)(password|secret|sasl\\.jaas|sasl\\.oauthbearer\\.config|ssl\\.key\\.pem|ssl_key|token)" $k }}
{{- fail (printf "config.kafka.properties.%s: a credential does not belong in the ConfigMap; set it in config.kafka.secretProperties (a Secret)" $k) }}
{{- end }}
{{ $k | quote }} = {{ $v | toString | quote }}
{{- end }}
{{- end }}
{{- range .Values.config.routes }}

[[routes]]
topics = [{{ range $i, $t := .topics }}{{ if $i }}, {{ end }}{{ $t | quote }}{{ end }}]
sink = {{ .sink | quote }}
{{- with .kafkaTopic }}
kafka_topic = {{ . | quote }}
{{- end }}
{{- with .format }}
format = {{ . | quote }}
{{- end }}
{{- if hasKey . "expandPayload" }}
expand_payload = {{ .expandPayload }}
{{- end }}
{{- if hasKey . "tombstoneOnEmpty" }}
tombstone_on_empty = {{ .tombstoneOnEmpty }}
{{- end }}
{{- with .source }}
source = {{ . | quote }}
{{- end }}
{{- with .contentMode }}
content_mode = {{ . | quote }}
{{- end }}
{{- end }}
{{- range .Values.config.schedules }}

[[schedules]]
name = {{ .name | quote }}
cron = {{ .cron | quote }}
topic = {{ .topic | quote }}
{{- with .timezone }}
timezone = {{ . | quote }}
{{- end }}
{{- if hasKey . "payload" }}
payload_json = {{ .payload | toJson | quote }}
{{- end }}
{{- with .key }}
key = {{ . | quote }}
{{- end }}
{{- with .maxAttempts }}
max_attempts = {{ . | int }}
{{- end }}
{{- end }}
{{- range .Values.config.limits }}

[[limits]]
topics = [{{ range $i, $t := .topics }}{{ if $i }}, {{ end }}{{ $t | quote }}{{ end }}]
max_running = {{ .maxRunning | int }}
per_key = {{ .perKey | default false }}
{{- end }}
{{- end }}

{{/*
The salt of the database Secret's checksum annotation: random once, then kept in the Secret
(read back with lookup on upgrades), so the annotation changes when the URL does without being a
plain hash of it (a hash of a password is a way to guess it).
*/}}
{{- define "postbox.checksumSalt" -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "postbox.fullname" .) -}}
{{- if and $existing $existing.data (hasKey $existing.data "checksum-salt") -}}
{{- index $existing.data "checksum-salt" | b64dec -}}
{{- else -}}
{{- randAlphaNum 32 -}}
{{- end -}}
{{- end -}}
