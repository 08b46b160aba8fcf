{{/* Names, labels and the pieces every Ray pod template shares. */}}

{{- define "msaserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Kept to 40 characters: KubeRay appends a hash and suffixes (-head-svc, -serve-svc) to it. */}}
{{- define "msaserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "msaserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "msaserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "msaserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "msaserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Labels of the Ray pod templates: no chart version or appVersion. The pod templates are part of
rayClusterConfig, and KubeRay replaces the whole cluster (blue/green, twice the GPUs) whenever that
changes; a chart bump alone must not.
*/}}
{{- define "msaserve.podLabels" -}}
{{ include "msaserve.selectorLabels" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The image, pinned by values alone (never by .Chart.AppVersion, see podLabels). */}}
{{- define "msaserve.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}
{{- end -}}

{{- define "msaserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "msaserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "msaserve.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "msaserve.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{- define "msaserve.rayTokenSecretName" -}}
{{- default (printf "%s-ray-token" (include "msaserve.fullname" .)) .Values.rayAuth.existingSecret -}}
{{- end -}}

{{- define "msaserve.apiServiceName" -}}
{{- printf "%s-api" (include "msaserve.fullname" .) -}}
{{- end -}}

{{/* KubeRay's head Service of the RayService: it follows the active cluster's head. */}}
{{- define "msaserve.headServiceName" -}}
{{- printf "%s-head-svc" (include "msaserve.fullname" .) -}}
{{- end -}}

{{/* Seconds the preStop drain may take: the grace period less the time `ray stop` needs after it. */}}
{{- define "msaserve.drainBudget" -}}
{{- sub (int .terminationGracePeriodSeconds) 60 -}}
{{- end -}}

{{- define "msaserve.kvcacheClaimName" -}}
{{- default (printf "%s-kvcache" (include "msaserve.fullname" .)) .Values.kvcache.storage.existingClaim -}}
{{- end -}}

{{/* The Serve HTTP port: serve.http.port (ServeConfig's default is 8000). */}}
{{- define "msaserve.servePort" -}}
{{- dig "http" "port" 8000 .Values.serve | int -}}
{{- end -}}

{{/* A group's rayStartParams; Ray exports metrics on metrics.port unless the group says otherwise. */}}
{{- define "msaserve.rayStartParams" -}}
{{- toYaml (merge (deepCopy (.params | default dict)) (dict "metrics-export-port" (toString .root.Values.metrics.port))) -}}
{{- end -}}

{{/* Container ports every Ray container exposes. */}}
{{- define "msaserve.workerPorts" -}}
- name: serve
  containerPort: {{ include "msaserve.servePort" . }}
  protocol: TCP
- name: metrics
  containerPort: {{ .Values.metrics.port }}
  protocol: TCP
{{- end -}}

{{/*
Environment of every Ray container. Ray reads HOME for caches: /tmp keeps the root fs read-only.
ctx: dict "root" $ "apiKeys" <bool>; the API keys go only to the group the gateway is pinned to.
*/}}
{{- define "msaserve.env" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: TRITON_CACHE_DIR
  value: /tmp/.triton
- name: HF_HOME
  value: /tmp/.cache/huggingface
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- /* The HTTP proxy's guard (msaserve/platform/http_limits.py), as `msaserve serve` installs it
locally: Serve's proxy on this pod calls the callback, which reads serve.http (ServeConfig defaults
for the rest) and sets uvicorn's trusted X-Forwarded-For peers to http.trusted_proxies. */}}
{{- $http := .root.Values.serve.http | default dict }}
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: msaserve.platform.http_limits:proxy_middlewares
- name: MSASERVE_PROXY_HTTP_LIMITS
  value: {{ toJson $http | quote }}
- name: FORWARDED_ALLOW_IPS
  value: {{ join "," (dig "trusted_proxies" list $http) | quote }}
{{- if and .apiKeys .root.Values.apiKeys.enabled }}
- name: MSASERVE_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "msaserve.apiKeysSecretName" .root }}
      key: {{ .root.Values.apiKeys.secretKey }}
{{- end }}
{{- end -}}

{{/* Volumes every Ray pod has; ctx: dict "root" $ "group" <group values>. */}}
{{- define "msaserve.baseVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .root.Values.tmpVolume.sizeLimit }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .group.shmSize }}
{{- if .drain }}
- name: drain
  configMap:
    name: {{ include "msaserve.fullname" .root }}-drain
{{- end }}
{{- end -}}

{{- define "msaserve.baseVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- if .drain }}
- name: drain
  mountPath: /etc/msaserve/drain
  readOnly: true
{{- end }}
{{- end -}}

{{/*
preStop of a worker: drain the Ray node (files/drain.py), so that Serve moves the replicas and lets
running requests finish before Kubernetes sends SIGTERM. ctx: the group's values.
*/}}
{{- define "msaserve.drainLifecycle" -}}
preStop:
  exec:
    command: ["python", "/etc/msaserve/drain/drain.py", "--budget-seconds", "{{ include "msaserve.drainBudget" . }}"]
{{- end -}}

{{/* The model volume (absent when the model is inside the image). */}}
{{- define "msaserve.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "download" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.download.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "msaserve.modelVolumeMount" -}}
{{- $m := .Values.model -}}
{{- if ne $m.source "image" }}
- name: model
  mountPath: {{ $m.mountPath }}
  readOnly: true
  {{- if and (eq $m.source "pvc") $m.pvc.subPath }}
  subPath: {{ $m.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Init container that downloads the model repository (model.source: download). */}}
{{- define "msaserve.modelInitContainers" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "download" }}
- name: download-model
  image: {{ include "msaserve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python", "-c"]
  args:
    - |
      import os
      from huggingface_hub import snapshot_download
      snapshot_download(repo_id=os.environ["REPO_ID"], revision=os.environ["REVISION"],
                        local_dir=os.environ["TARGET"])
  env:
    - name: REPO_ID
      value: {{ $m.download.repoId | quote }}
    - name: REVISION
      value: {{ $m.download.revision | quote }}
    - name: TARGET
      value: {{ printf "%s/%s" $m.mountPath $m.download.targetDir | quote }}
    - name: HOME
      value: /tmp
    - name: HF_HOME
      value: /tmp/.cache/huggingface
    {{- if $m.download.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $m.download.tokenSecret.name }}
          key: {{ $m.download.tokenSecret.key }}
    {{- end }}
  resources:
    {{- toYaml $m.download.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: model
      mountPath: {{ $m.mountPath }}
{{- end }}
{{- end -}}

{{/*
Scheduling and security fields of a pod spec; ctx: dict "root" $ "group" <group values>
"apiToken" <bool>. Only the head with the autoscaler gets a Kubernetes API token: KubeRay's
autoscaler sidecar patches the RayCluster with it (KubeRay binds its Role to this ServiceAccount).
*/}}
{{- define "msaserve.podScheduling" -}}
serviceAccountName: {{ include "msaserve.serviceAccountName" .root }}
automountServiceAccountToken: {{ if .apiToken }}true{{ else }}false{{ end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
