{{/* One copy of each rule that several templates use; deploy/render.py holds the same rules. */}}
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
