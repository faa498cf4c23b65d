{{/* Names ----------------------------------------------------------------------------- */}}

{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvroute.fullname" -}}
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

{{/* <fullname>-<suffix>, within 63 characters */}}
{{- define "kvroute.componentName" -}}
{{- $full := include "kvroute.fullname" .root -}}
{{- printf "%s-%s" ($full | trunc (int (sub 62 (len .component)))) .component | replace "--" "-" -}}
{{- end -}}

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels: call with (dict "root" $ "component" "router") */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" .root }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- end -}}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Redis ------------------------------------------------------------------------------ */}}

{{/* The Redis URL the config file carries: the bundled Valkey, else redis.url, else
     config.redis_url ("" when Redis is off or the URL comes from a Secret only). */}}
{{- define "kvroute.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:6379/0" (include "kvroute.componentName" (dict "root" . "component" "redis")) -}}
{{- else if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else -}}
{{- .Values.config.redis_url | default "" -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.redisOn" -}}
{{- if or (include "kvroute.redisUrl" .) .Values.redis.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "kvroute.indexerOn" -}}
{{- if and (include "kvroute.redisOn" .) .Values.indexer.enabled -}}true{{- end -}}
{{- end -}}

{{/* Discovery ---------------------------------------------------------------------------- */}}

{{- define "kvroute.discoveryKind" -}}
{{- if include "kvroute.poolDiscovery" . -}}
k8s
{{- else -}}
{{- (.Values.config.discovery | default dict).kind | default "static" -}}
{{- end -}}
{{- end -}}

{{/* Endpoint picker (mode: epp) ------------------------------------------------------- */}}

{{- define "kvroute.epp" -}}
{{- if eq (.Values.mode | default "proxy") "epp" -}}true{{- end -}}
{{- end -}}

{{/* "true" when discovery comes from the InferencePool's selector */}}
{{- define "kvroute.poolDiscovery" -}}
{{- if and (include "kvroute.epp" .) .Values.epp.inferencePool.matchLabels -}}true{{- end -}}
{{- end -}}

{{- define "kvroute.poolName" -}}
{{- .Values.epp.inferencePool.name | default (include "kvroute.fullname" .) -}}
{{- end -}}

{{- /* the pool's target ports, a JSON list of ints: epp.inferencePool.targetPorts, else
       [targetPort] (values.schema.json: at most 8, distinct, as GIE's CRD) */ -}}
{{- define "kvroute.poolPorts" -}}
{{- $pool := .Values.epp.inferencePool -}}
{{- $ports := list -}}
{{- range ($pool.targetPorts | default (list $pool.targetPort)) -}}
{{- $ports = append $ports (int .) -}}
{{- end -}}
{{- toJson $ports -}}
{{- end -}}

{{/* matchLabels as a label selector: k=v,k2=v2 (sorted) */}}
{{- define "kvroute.poolSelector" -}}
{{- $pairs := list -}}
{{- range $k, $v := .Values.epp.inferencePool.matchLabels -}}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* The namespace kubernetes discovery watches (config.discovery.k8s.namespace, else the
     service account's own: the release namespace). */}}
{{- define "kvroute.watchNamespace" -}}
{{- $k8s := (.Values.config.discovery | default dict).k8s | default dict -}}
{{- $k8s.namespace | default .Release.Namespace -}}
{{- end -}}

{{/* The router's config file: .Values.config with redis_url from redis.* ------------------ */}}
{{- define "kvroute.configFile" -}}
{{- $config := deepCopy (.Values.config | default dict) -}}
{{- $url := include "kvroute.redisUrl" . -}}
{{- if $url -}}
{{- $_ := set $config "redis_url" $url -}}
{{- end -}}
{{- if .Values.redis.username -}}
{{- $_ := set $config "redis_username" .Values.redis.username -}}
{{- end -}}
{{- if .Values.redis.passwordSecret.name -}}
{{- $_ := set $config "redis_password_file" "/etc/kvroute-secrets/redis-password" -}}
{{- end -}}
{{- if .Values.redis.caSecret.name -}}
{{- $_ := set $config "redis_ca_file" "/etc/kvroute-secrets/redis-ca.pem" -}}
{{- end -}}
{{- if include "kvroute.poolDiscovery" . -}}
{{- /* epp mode: the InferencePool's pods are the pods kvroute discovers */ -}}
{{- $discovery := deepCopy ($config.discovery | default dict) -}}
{{- $k8s := deepCopy ($discovery.k8s | default dict) -}}
{{- $_ := set $k8s "label_selector" (include "kvroute.poolSelector" .) -}}
{{- $ports := include "kvroute.poolPorts" . | fromJsonArray -}}
{{- $_ := set $k8s "port" (int (first $ports)) -}}
{{- if gt (len $ports) 1 -}}
{{- $_ := set $k8s "ports" $ports -}}
{{- else -}}
{{- $_ := unset $k8s "ports" -}}
{{- end -}}
{{- $_ := set $discovery "kind" "k8s" -}}
{{- $_ := set $discovery "k8s" $k8s -}}
{{- $_ := unset $discovery "static" -}}
{{- $_ := unset $discovery "dns" -}}
{{- $_ := set $config "discovery" $discovery -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Environment shared by the router and the indexer */}}
{{- define "kvroute.env" -}}
- name: HOME
  value: /tmp
{{- if .Values.redis.existingSecret }}
- name: KVROUTE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- end }}
{{- if .Values.apiKeys.existingSecret }}
- name: KVROUTE_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeys.existingSecret }}
      key: {{ .Values.apiKeys.key }}
{{- end }}
{{- $tenants := include "kvroute.tenantsSecret" . }}
{{- if $tenants }}
- name: KVROUTE_TENANTS
  valueFrom:
    secretKeyRef:
      name: {{ $tenants }}
      key: tenants.json
- name: KVROUTE_TENANT_SALT_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ $tenants }}
      key: salt-secret
- name: KVROUTE_ADMIN_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ $tenants }}
      key: admin-keys
      optional: true
- name: KVROUTE_ADMIN_KEY_SHA256
  valueFrom:
    secretKeyRef:
      name: {{ $tenants }}
      key: admin-key-sha256
      optional: true
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The Secret holding the tenants: tenants.existingSecret, or the rendered one */}}
{{- define "kvroute.tenantsSecret" -}}
{{- if .Values.tenants.existingSecret -}}
{{- .Values.tenants.existingSecret -}}
{{- else if .Values.tenants.list -}}
{{- printf "%s-tenants" (include "kvroute.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Secrets mounted as files (Redis password, Redis CA): volumes and mounts */}}
{{- define "kvroute.secretVolumes" -}}
{{- if or .Values.redis.passwordSecret.name .Values.redis.caSecret.name }}
- name: secrets
  projected:
    sources:
      {{- with .Values.redis.passwordSecret.name }}
      - secret:
          name: {{ . }}
          items:
            - {key: {{ $.Values.redis.passwordSecret.key }}, path: redis-password}
      {{- end }}
      {{- with .Values.redis.caSecret.name }}
      - secret:
          name: {{ . }}
          items:
            - {key: {{ $.Values.redis.caSecret.key }}, path: redis-ca.pem}
      {{- end }}
{{- end }}
{{- end -}}

{{- define "kvroute.secretMounts" -}}
{{- if or .Values.redis.passwordSecret.name .Values.redis.caSecret.name }}
- name: secrets
  mountPath: /etc/kvroute-secrets
  readOnly: true
{{- end }}
{{- end -}}

{{/* Combinations that cannot work: fail the render with the reason ------------------------ */}}
{{- define "kvroute.validate" -}}
{{- $writer := .Values.config.index_writer | default false -}}
{{- if and (include "kvroute.epp" .) .Values.epp.inferencePool.create (not .Values.epp.inferencePool.matchLabels) -}}
{{- fail "mode epp renders an InferencePool: set epp.inferencePool.matchLabels to the model server pods' labels (or epp.inferencePool.create: false)" -}}
{{- end -}}
{{- if and .Values.tenants.list (not .Values.tenants.existingSecret) (not .Values.tenants.saltSecret) -}}
{{- fail "tenants.list needs tenants.saltSecret (>= 32 characters; or use tenants.existingSecret with a salt-secret key)" -}}
{{- end -}}
{{- if and .Values.redis.enabled .Values.redis.url -}}
{{- fail "redis.enabled (the bundled Valkey) and redis.url (an external Redis) are both set: choose one" -}}
{{- end -}}
{{- if include "kvroute.redisOn" . -}}
{{- if and .Values.indexer.enabled $writer -}}
{{- fail "config.index_writer is true and indexer.enabled: two processes would write the Redis index; keep one" -}}
{{- end -}}
{{- if and (not .Values.indexer.enabled) (not $writer) -}}
{{- fail "Redis is on but nothing writes the index: enable indexer (recommended) or set config.index_writer: true on a single router replica" -}}
{{- end -}}
{{- if and $writer (or (gt (int .Values.replicaCount) 1) .Values.autoscaling.enabled) -}}
{{- fail "config.index_writer: true needs exactly one router replica (replicaCount 1, no autoscaling); with more, use indexer.enabled" -}}
{{- end -}}
{{- end -}}
{{- end -}}
