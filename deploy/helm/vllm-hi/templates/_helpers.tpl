{{/* The release's prefix for every object's name. */}}
{{- define "vllm-hi.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vllm-hi.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "vllm-hi.hostSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: host
{{- end -}}

{{- define "vllm-hi.hostName" -}}
{{- printf "%s-host" (include "vllm-hi.fullname" .) -}}
{{- end -}}

{{- define "vllm-hi.tokensSecret" -}}
{{- default (printf "%s-tokens" (include "vllm-hi.fullname" .)) .Values.tokens.existingSecret -}}
{{- end -}}

{{- define "vllm-hi.vhiImage" -}}
{{- printf "%s:%s" .Values.images.vhi.repository (default .Chart.AppVersion .Values.images.vhi.tag) -}}
{{- end -}}

{{- define "vllm-hi.engineImage" -}}
{{- printf "%s:%s" .Values.images.engine.repository (default .Chart.AppVersion .Values.images.engine.tag) -}}
{{- end -}}

{{/* Whether the Host's state is shared (etcd): several Hosts may run. */}}
{{- define "vllm-hi.sharedStore" -}}
{{- if hasPrefix "etcd://" .Values.host.store -}}true{{- end -}}
{{- end -}}
