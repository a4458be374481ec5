{{/*
Chart name, truncated to a DNS label.
*/}}
{{- define "embedfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full resource name prefix. Truncated so that the longest suffix used by the
chart ("-query-worker", 13 characters) still fits in 63 characters.
*/}}
{{- define "embedfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "embedfleet.workerName" -}}
{{- printf "%s-worker" (include "embedfleet.fullname" .) }}
{{- end }}

{{/*
A model lane's name (models[].name, shared/keys.py MODEL_LANE_PATTERN) as a DNS label: lower
case, every other character a dash.
*/}}
{{- define "embedfleet.modelSlug" -}}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$" (toString .)) }}
{{- fail (printf "models[].name %q is not a model lane name: letters, digits and '.', '_', '/', '-', starting with a letter or digit" (toString .)) }}
{{- end }}
{{- regexReplaceAll "[^a-z0-9-]+" (lower (toString .)) "-" | trimAll "-" }}
{{- end }}

{{/* The worker Deployment of one entry of `models`: <fullname>-m-<slug>. */}}
{{- define "embedfleet.modelWorkerName" -}}
{{- printf "%s-m-%s" (include "embedfleet.fullname" .root) (include "embedfleet.modelSlug" .model.name) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "embedfleet.queryWorkerName" -}}
{{- printf "%s-query-worker" (include "embedfleet.fullname" .) }}
{{- end }}

{{- define "embedfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels shared by every object.
*/}}
{{- define "embedfleet.labels" -}}
helm.sh/chart: {{ include "embedfleet.chart" . }}
{{ include "embedfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: embedfleet
{{- end }}

{{/*
Selector labels common to both worker Deployments (the metrics Service selects on these).
*/}}
{{- define "embedfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "embedfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Selector labels of one component. Call with (dict "root" $ "component" "worker").
*/}}
{{- define "embedfleet.componentSelectorLabels" -}}
{{ include "embedfleet.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "embedfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "embedfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "embedfleet.image" -}}
{{- $variantTag := .Chart.AppVersion -}}
{{- if eq (.Values.image.variant | default "cpu") "cuda" }}{{ $variantTag = printf "%s-cuda" .Chart.AppVersion }}{{ end -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default $variantTag | toString) }}
{{- end }}

{{/*
The gateway's image: `make image-gateway`'s tag (<appVersion>-gateway) of the workers'
repository unless gateway.image says otherwise. The worker images lack the gateway extra.
*/}}
{{- define "embedfleet.gatewayImage" -}}
{{- $g := .Values.gateway.image | default dict }}
{{- $repository := $g.repository | default .Values.image.repository }}
{{- printf "%s:%s" $repository ($g.tag | default (printf "%s-gateway" .Chart.AppVersion) | toString) }}
{{- end }}

{{/*
Autoscaling of the workers. KEDA's objects are rendered only when keda.enabled and the cluster
serves KEDA's API, so the chart installs on a cluster without KEDA (an unknown kind would fail
the whole release); the workers then fall back to the CPU HPA when autoscaling.hpa.enabled, or
to replicaCount, and NOTES.txt says so. `helm template` sees no cluster: give it
`--api-versions keda.sh/v1alpha1` to render the ScaledObject.
*/}}
{{- define "embedfleet.kedaApi" -}}keda.sh/v1alpha1{{- end }}

{{- define "embedfleet.kedaActive" -}}
{{- if and .Values.keda.enabled (.Capabilities.APIVersions.Has (include "embedfleet.kedaApi" .)) }}true{{- end }}
{{- end }}

{{- define "embedfleet.hpaActive" -}}
{{- if and (not (include "embedfleet.kedaActive" .)) .Values.autoscaling.hpa.enabled }}true{{- end }}
{{- end }}

{{/*
Redis key names, as in shared/keys.py: <namespace>:ingest, <namespace>:query.
*/}}
{{- define "embedfleet.keyNamespace" -}}
{{- (.Values.config | default dict).NAMESPACE | default "embedfleet" | toString }}
{{- end }}

{{- define "embedfleet.consumerGroup" -}}
{{- (.Values.config | default dict).GROUP | default "workers" | toString }}
{{- end }}

{{- define "embedfleet.ingestStream" -}}
{{- printf "%s:ingest" (include "embedfleet.keyNamespace" .) }}
{{- end }}

{{- define "embedfleet.queryStream" -}}
{{- printf "%s:query" (include "embedfleet.keyNamespace" .) }}
{{- end }}

{{/*
With partitions: every partition's ingest stream, as a JSON list, from the tag table that
shared/keys.py generates (files/partition-tags.json): <namespace>:{<tag>}:ingest.
*/}}
{{- define "embedfleet.ingestStreams" -}}
{{- $n := int .Values.partitions }}
{{- if le $n 1 }}
{{- list (include "embedfleet.ingestStream" .) | toJson }}
{{- else }}
{{- $tags := get (.Files.Get "files/partition-tags.json" | fromJson) (toString $n) }}
{{- $ns := include "embedfleet.keyNamespace" . }}
{{- $streams := list }}
{{- range $tags }}
{{- $streams = append $streams (printf "%s:{%s}:ingest" $ns .) }}
{{- end }}
{{- $streams | toJson }}
{{- end }}
{{- end }}

{{/*
The named tenants' ingest streams (shared/keys.py Keys.ingest_for: <partition's ingest>:t:<name>),
as a JSON list of {name, stream}: one per listed tenant (tenants) and partition, the trigger
named t<j>p<i>. The default tenant (config.DEFAULT_TENANT, else "default") reads the plain
ingest streams, which have their triggers already.
*/}}
{{- define "embedfleet.tenantStreams" -}}
{{- $default := (.Values.config | default dict).DEFAULT_TENANT | default "default" | toString }}
{{- $streams := include "embedfleet.ingestStreams" . | fromJsonArray }}
{{- $out := list }}
{{- range $j, $tenant := .Values.tenants }}
{{- if ne $tenant.name $default }}
{{- range $i, $stream := $streams }}
{{- $out = append $out (dict "name" (printf "t%dp%d" $j $i) "stream" (printf "%s:t:%s" $stream $tenant.name)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $out | toJson }}
{{- end }}

{{/* The query stream: the priority streams have their own tag when there are partitions. */}}
{{- define "embedfleet.queryLaneStream" -}}
{{- if gt (int .Values.partitions) 1 }}
{{- printf "%s:{q}:query" (include "embedfleet.keyNamespace" .) }}
{{- else }}
{{- include "embedfleet.queryStream" . }}
{{- end }}
{{- end }}

{{- /* The gateway's large requests (shared/keys.py Keys.interactive): in the priority streams' key
      set, so under its hash tag with partitions. */}}
{{- define "embedfleet.interactiveStream" -}}
{{- if gt (int .Values.partitions) 1 }}
{{- printf "%s:{q}:interactive" (include "embedfleet.keyNamespace" .) }}
{{- else }}
{{- printf "%s:interactive" (include "embedfleet.keyNamespace" .) }}
{{- end }}
{{- end }}

{{- define "embedfleet.healthPort" -}}
{{- (.Values.config | default dict).HEALTH_PORT | default 9400 | int }}
{{- end }}

{{/*
Seconds the kubelet waits after SIGTERM: the drain timeout plus a margin.
*/}}
{{- define "embedfleet.terminationGracePeriodSeconds" -}}
{{- add (int .Values.drainTimeoutSeconds) (int .Values.terminationGraceMarginSeconds) }}
{{- end }}

{{/*
A setting value as the string an environment variable carries. Whole numbers
stay whole (YAML numbers arrive as float64), lists and maps become JSON.
*/}}
{{- define "embedfleet.envString" -}}
{{- if kindIs "float64" . }}
{{- if eq (float64 (int64 .)) . }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if or (kindIs "map" .) (kindIs "slice" .) }}
{{- toJson . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/*
Redis connection: which Secret and keys hold the URL and credentials.
*/}}
{{- define "embedfleet.redisSecretName" -}}
{{- if .Values.redis.existingSecret }}
{{- .Values.redis.existingSecret }}
{{- else }}
{{- printf "%s-redis" (include "embedfleet.fullname" .) }}
{{- end }}
{{- end }}

{{- define "embedfleet.redisSecretUrlKey" -}}
{{- if .Values.redis.existingSecret }}
{{- required "redis.existingSecretKey is required with redis.existingSecret" .Values.redis.existingSecretKey }}
{{- else }}
{{- "redis-url" }}
{{- end }}
{{- end }}

{{/*
The parsed redis.url (empty dict when an existing Secret is used).
*/}}
{{- define "embedfleet.redisUrlParts" -}}
{{- if .Values.redis.existingSecret }}
{{- dict | toJson }}
{{- else }}
{{- $url := required "set redis.url (redis://[user:password@]host:port/db or rediss://...) or redis.existingSecret" .Values.redis.url }}
{{- if not (regexMatch "^rediss?://" $url) }}
{{- fail (printf "redis.url must start with redis:// or rediss://, got %q" $url) }}
{{- end }}
{{- $u := urlParse $url }}
{{- $userinfo := $u.userinfo | default "" }}
{{- $username := "" }}
{{- $password := "" }}
{{- if contains ":" $userinfo }}
{{- $parts := splitn ":" 2 $userinfo }}
{{- $username = $parts._0 }}
{{- $password = $parts._1 }}
{{- else }}
{{- $username = $userinfo }}
{{- end }}
{{- $host := $u.host }}
{{- if not (regexMatch ":[0-9]+$" $host) }}
{{- $host = printf "%s:6379" $host }}
{{- end }}
{{- $db := trimPrefix "/" ($u.path | default "") }}
{{- dict "scheme" $u.scheme "address" $host "username" $username "password" $password "database" $db | toJson }}
{{- end }}
{{- end }}

{{- define "embedfleet.redisTls" -}}
{{- $u := include "embedfleet.redisUrlParts" . | fromJson }}
{{- if or .Values.redis.tls (eq ($u.scheme | default "") "rediss") }}true{{ end }}
{{- end }}

{{/*
Whether a TriggerAuthentication is needed, and which secret keys it reads.
*/}}
{{- define "embedfleet.redisPasswordKey" -}}
{{- if .Values.redis.existingSecret }}
{{- .Values.redis.existingSecretPasswordKey }}
{{- else }}
{{- $u := include "embedfleet.redisUrlParts" . | fromJson }}
{{- if $u.password }}redis-password{{ end }}
{{- end }}
{{- end }}

{{- define "embedfleet.redisUsernameKey" -}}
{{- if .Values.redis.existingSecret }}
{{- .Values.redis.existingSecretUsernameKey }}
{{- else }}
{{- $u := include "embedfleet.redisUrlParts" . | fromJson }}
{{- if $u.username }}redis-username{{ end }}
{{- end }}
{{- end }}

{{- define "embedfleet.triggerAuthName" -}}
{{- printf "%s-redis" (include "embedfleet.fullname" .) }}
{{- end }}

{{/*
Metadata of a KEDA redis-streams lag trigger. Call with
(dict "root" $ "stream" "<ns>:ingest" "lagCount" 5000 "activationLagCount" 0).
All values are strings, as KEDA requires.
*/}}
{{/* "true" when the workers talk to a Redis Cluster (redis.cluster). */}}
{{- define "embedfleet.redisCluster" -}}
{{- if .Values.redis.cluster }}true{{ else }}false{{ end }}
{{- end }}

{{/* KEDA's scaler type for a stream: the cluster scaler on a Redis Cluster. */}}
{{- define "embedfleet.streamScaler" -}}
{{- ternary "redis-cluster-streams" "redis-streams" (eq (include "embedfleet.redisCluster" .) "true") }}
{{- end }}

{{/*
Several lag triggers (one per partition, or the cluster scaler's) are summed into one metric
(advanced.scalingModifiers) rather than KEDA's default, the largest of them.
*/}}
{{- define "embedfleet.triggersSummed" -}}
{{- $streams := include "embedfleet.ingestStreams" . | fromJsonArray }}
{{- $tenants := include "embedfleet.tenantStreams" . | fromJsonArray }}
{{- if or (gt (len $streams) 1) $tenants (eq (include "embedfleet.streamScaler" .) "redis-cluster-streams") }}true{{- end }}
{{- end }}

{{/*
What wakes and sizes the bulk workers, as a JSON list: one entry per stream that work arrives
on, from the Producer and from the gateway (small requests go to the query stream, large ones and
batches to the ingest streams). Each entry: the trigger's name, its stream, the lag per replica,
the activation lag, and its weight, how many ingest entries one of its entries counts as when
the triggers are summed. A stream the workers start reading is one more `append` here.
*/}}
{{- define "embedfleet.workerTriggers" -}}
{{- $k := .Values.keda }}
{{- $summed := eq (include "embedfleet.triggersSummed" .) "true" }}
{{- $triggers := list }}
{{- range $i, $stream := include "embedfleet.ingestStreams" . | fromJsonArray }}
{{- $triggers = append $triggers (dict "name" (ternary (printf "p%d" $i) "ingest-lag" $summed) "stream" $stream "lagCount" $k.lagCount "activationLagCount" $k.activationLagCount "weight" 1) }}
{{- end }}
{{- /* every listed tenant's own streams: their lag is backlog like the plain streams' */}}
{{- range include "embedfleet.tenantStreams" . | fromJsonArray }}
{{- $triggers = append $triggers (dict "name" .name "stream" .stream "lagCount" $k.lagCount "activationLagCount" $k.activationLagCount "weight" 1) }}
{{- end }}
{{- /* The gateway's large requests: someone waits on them, so any entry wakes a fleet scaled to
      zero; one entry is one text, as on the ingest streams. Bulk workers read the stream. */}}
{{- $triggers = append $triggers (dict "name" (ternary "interactive" "interactive-lag" $summed) "stream" (include "embedfleet.interactiveStream" .) "lagCount" $k.lagCount "activationLagCount" 0 "weight" 1) }}
{{- if not .Values.queryWorkers.enabled }}
{{- /* No query workers: a query (the gateway's small requests) must wake a fleet scaled to zero;
      it activates at any lag and counts as much as lagCount/queryLagCount bulk entries. */}}
{{- $queryWeight := max 1 (div (int $k.lagCount) (max 1 (int $k.queryLagCount))) }}
{{- $triggers = append $triggers (dict "name" (ternary "query" "query-lag" $summed) "stream" (include "embedfleet.queryLaneStream" .) "lagCount" $k.queryLagCount "activationLagCount" 0 "weight" $queryWeight) }}
{{- end }}
{{- toJson $triggers }}
{{- end }}

{{- define "embedfleet.redisStreamsTriggerMetadata" -}}
{{- $root := .root }}
{{- $u := include "embedfleet.redisUrlParts" $root | fromJson }}
{{- $field := ternary "addresses" "address" (eq (include "embedfleet.redisCluster" $root) "true") }}
{{- if $root.Values.redis.address }}
{{ $field }}: {{ $root.Values.redis.address | quote }}
{{- else if $u.address }}
{{ $field }}: {{ $u.address | quote }}
{{- else if $root.Values.redis.existingSecretAddressKey }}
{{ $field }}FromEnv: REDIS_ADDRESS
{{- else }}
{{- fail "KEDA needs the Redis address: set redis.address (host:port) or redis.existingSecretAddressKey when redis.existingSecret is used" }}
{{- end }}
stream: {{ .stream | quote }}
consumerGroup: {{ include "embedfleet.consumerGroup" $root | quote }}
lagCount: {{ include "embedfleet.envString" .lagCount | quote }}
activationLagCount: {{ include "embedfleet.envString" .activationLagCount | quote }}
{{- if eq (include "embedfleet.redisCluster" $root) "true" }}
{{- /* a cluster has database 0 only; the scaler takes no index */}}
{{- else if not (kindIs "invalid" $root.Values.redis.database) }}
databaseIndex: {{ include "embedfleet.envString" $root.Values.redis.database | quote }}
{{- else if regexMatch "^[0-9]+$" ($u.database | default "") }}
databaseIndex: {{ $u.database | quote }}
{{- end }}
{{- if include "embedfleet.redisTls" $root }}
enableTLS: "true"
{{- if $root.Values.redis.tlsInsecureSkipVerify }}
unsafeSsl: "true"
{{- end }}
{{- end }}
{{- end }}

{{/*
The worker pod template. Call with
(dict "root" $ "component" "worker" "command" (list ...) "args" (list ...) "gpu" {...} "resources" {...}
      "nodeSelector" {...} "tolerations" [...] "affinity" {...}).
*/}}
{{- define "embedfleet.podTemplate" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $gpu := .gpu }}
{{- $modelReplicas := int (.modelReplicas | default 1) }}
{{- if and $gpu.enabled (gt $modelReplicas 1) (gt (int $gpu.count) 1) }}
{{- fail "modelReplicas > 1 shares one GPU among the replicas (each uses the first device it sees): set gpu.count to 1" }}
{{- end }}
{{- $resources := deepCopy (.resources | default dict) }}
{{- if $gpu.enabled }}
{{- $limits := $resources.limits | default dict }}
{{- $requests := $resources.requests | default dict }}
{{- $_ := set $limits $gpu.resourceName (int $gpu.count) }}
{{- $_ := set $requests $gpu.resourceName (int $gpu.count) }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set $resources "requests" $requests }}
{{- end }}
{{- $tolerations := .tolerations | default list }}
{{- if and $gpu.enabled $gpu.tolerateTaint }}
{{- $tolerations = append $tolerations (dict "key" $gpu.resourceName "operator" "Exists" "effect" "NoSchedule") }}
{{- end }}
metadata:
  labels:
    {{- include "embedfleet.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    {{- if not $v.redis.existingSecret }}
    checksum/secret: {{ include (print $root.Template.BasePath "/secret.yaml") $root | sha256sum }}
    {{- end }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "embedfleet.serviceAccountName" $root }}
  automountServiceAccountToken: {{ $v.serviceAccount.automountServiceAccountToken }}
  terminationGracePeriodSeconds: {{ include "embedfleet.terminationGracePeriodSeconds" $root }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $v.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: worker
      image: {{ include "embedfleet.image" $root | quote }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command:
        {{- toYaml .command | nindent 8 }}
      {{- with .args }}
      args:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        - name: http
          containerPort: {{ include "embedfleet.healthPort" $root }}
          protocol: TCP
        {{- range $i := untilStep 1 $modelReplicas 1 }}
        - name: {{ printf "http-r%d" $i }}
          containerPort: {{ add (include "embedfleet.healthPort" $root | int) $i }}
          protocol: TCP
        {{- end }}
      envFrom:
        - configMapRef:
            name: {{ include "embedfleet.fullname" $root }}
        {{- with $v.extraEnvFrom }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      env:
        - name: EMBEDFLEET_REDIS_URL
          valueFrom:
            secretKeyRef:
              name: {{ include "embedfleet.redisSecretName" $root }}
              key: {{ include "embedfleet.redisSecretUrlKey" $root }}
        {{- if and $v.redis.existingSecret $v.redis.existingSecretAddressKey }}
        - name: REDIS_ADDRESS
          valueFrom:
            secretKeyRef:
              name: {{ $v.redis.existingSecret }}
              key: {{ $v.redis.existingSecretAddressKey }}
        {{- end }}
        - name: HF_HOME
          value: {{ printf "%s/huggingface" $v.cache.mountPath | quote }}
        - name: XDG_CACHE_HOME
          value: {{ $v.cache.mountPath | quote }}
        - name: HOME
          value: /tmp
        {{- /* always: the worker's own default (auto) sizes from the node's cores on CUDA, and
        the chart must know the count to declare a port per replica */}}
        - name: EMBEDFLEET_REPLICAS
          value: {{ $modelReplicas | quote }}
        {{- range .env }}
        - name: {{ .name }}
          value: {{ .value | quote }}
        {{- end }}
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      startupProbe:
        httpGet:
          path: /healthz
          port: http
        {{- toYaml $v.probes.startup | nindent 8 }}
      livenessProbe:
        httpGet:
          path: /healthz
          port: http
        {{- toYaml $v.probes.liveness | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /readyz
          port: http
        {{- toYaml $v.probes.readiness | nindent 8 }}
      {{- with $resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        - name: cache
          mountPath: {{ $v.cache.mountPath }}
        {{- if $v.modelVolume.enabled }}
        - name: model
          mountPath: {{ $v.modelVolume.mountPath }}
          readOnly: true
          {{- with $v.modelVolume.subPath }}
          subPath: {{ . }}
          {{- end }}
        {{- end }}
  volumes:
    - name: tmp
      {{- $tmpDir := dict }}
      {{- with $v.tmp.sizeLimit }}{{ $_ := set $tmpDir "sizeLimit" . }}{{ end }}
      emptyDir: {{- toYaml $tmpDir | nindent 8 }}
    - name: cache
      {{- $cacheDir := dict }}
      {{- with $v.cache.medium }}{{ $_ := set $cacheDir "medium" . }}{{ end }}
      {{- with $v.cache.sizeLimit }}{{ $_ := set $cacheDir "sizeLimit" . }}{{ end }}
      emptyDir: {{- toYaml $cacheDir | nindent 8 }}
    {{- if $v.modelVolume.enabled }}
    - name: model
      {{- if eq $v.modelVolume.type "pvc" }}
      persistentVolumeClaim:
        claimName: {{ required "modelVolume.claimName is required when modelVolume.type is pvc" $v.modelVolume.claimName }}
        readOnly: true
      {{- else if eq $v.modelVolume.type "hostPath" }}
      hostPath:
        path: {{ required "modelVolume.hostPath is required when modelVolume.type is hostPath" $v.modelVolume.hostPath }}
        {{- with $v.modelVolume.hostPathType }}
        type: {{ . }}
        {{- end }}
      {{- else }}
      {{- fail (printf "modelVolume.type must be pvc or hostPath, got %q" $v.modelVolume.type) }}
      {{- end }}
    {{- end }}
  {{- with .nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
