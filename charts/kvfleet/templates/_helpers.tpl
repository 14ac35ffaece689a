{{- define "kvfleet.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvfleet.labels" -}}
app.kubernetes.io/part-of: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "kvfleet.operatorName" -}}{{ .Release.Name }}-operator{{- end -}}
{{- define "kvfleet.routerName" -}}{{ .Release.Name }}-router{{- end -}}
{{- define "kvfleet.gatewayName" -}}{{ .Release.Name }}-gateway{{- end -}}

{{- /* The router's Service as Envoy dials it for ADS and ext_proc. */ -}}
{{- define "kvfleet.routerHost" -}}
{{ include "kvfleet.routerName" . }}.{{ .Release.Namespace }}.svc.{{ .Values.gateway.clusterDomain }}
{{- end -}}

{{- define "kvfleet.allNamespaces" -}}{{ if .Values.operator.watchNamespaces }}false{{ else }}true{{ end }}{{- end -}}
