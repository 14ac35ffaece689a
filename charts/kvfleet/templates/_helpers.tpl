{{- define "kvfleet.registryPrefix" -}}
{{- with .Values.image.registry }}{{ trimSuffix "/" . }}/{{ end -}}
{{- end -}}

{{- define "kvfleet.image" -}}
{{ include "kvfleet.registryPrefix" . }}{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvfleet.engineImage.cpu" -}}
{{ include "kvfleet.registryPrefix" . }}{{ .Values.engineImage.cpu.repository }}:{{ .Values.engineImage.cpu.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvfleet.engineImage.cuda" -}}
{{ include "kvfleet.registryPrefix" . }}{{ .Values.engineImage.cuda.repository }}:{{ .Values.engineImage.cuda.tag | default .Chart.AppVersion }}
{{- end -}}

{{- /* The pod-level security every kvfleet pod runs with (the images' numeric user, images/Containerfile). */ -}}
{{- define "kvfleet.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
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
