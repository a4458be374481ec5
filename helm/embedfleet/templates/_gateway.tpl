{{/* The HTTP gateway (`embedfleet serve`). */}}
{{- define "embedfleet.gatewayName" -}}
{{- printf "%s-gateway" (include "embedfleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "embedfleet.gatewayKeysSecretName" -}}
{{- .Values.gateway.apiKeys.existingSecret | default (printf "%s-api-keys" (include "embedfleet.gatewayName" .)) }}
{{- end }}

{{- define "embedfleet.gatewayHasKeys" -}}
{{- if or .Values.gateway.apiKeys.existingSecret .Values.gateway.apiKeys.keys }}true{{- end }}
{{- end }}

{{- define "embedfleet.gatewayFilesClaim" -}}
{{- .Values.gateway.files.existingClaim | default (printf "%s-files" (include "embedfleet.gatewayName" .)) }}
{{- end }}
