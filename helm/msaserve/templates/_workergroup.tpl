{{/*
One entry of workerGroupSpecs. ctx: dict "root" $ "group" <group values> "groupName" <name>
"component" <label> "gpus" <int, 0 for CPU groups> "volumes" <yaml> "mounts" <yaml> "model" <bool>
"apiKeys" <bool: the gateway runs here, so the pods get MSASERVE_API_KEYS>.
*/}}
{{- define "msaserve.workerGroup" -}}
{{- $root := .root -}}
{{- $g := .group -}}
- groupName: {{ .groupName }}
  replicas: {{ $g.replicas }}
  minReplicas: {{ $g.minReplicas }}
  maxReplicas: {{ $g.maxReplicas }}
  rayStartParams:
    {{- include "msaserve.rayStartParams" (dict "root" $root "params" $g.rayStartParams) | nindent 4 }}
  {{- with $g.rayResources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  template:
    metadata:
      labels:
        {{- include "msaserve.podLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .component }}
      {{- with $g.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "msaserve.podScheduling" . | nindent 6 }}
      terminationGracePeriodSeconds: {{ $g.terminationGracePeriodSeconds }}
      {{- if .model }}
      {{- with include "msaserve.modelInitContainers" $root | trim }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      {{- end }}
      containers:
        # KubeRay runs `ray start` in the first container.
        - name: ray-worker
          image: {{ include "msaserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          ports:
            {{- include "msaserve.workerPorts" $root | nindent 12 }}
          env:
            {{- include "msaserve.env" (dict "root" $root "apiKeys" .apiKeys) | nindent 12 }}
            {{- with $g.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            requests:
              {{- toYaml $g.resources.requests | nindent 14 }}
              {{- if .gpus }}
              nvidia.com/gpu: {{ .gpus }}
              {{- end }}
            limits:
              {{- toYaml $g.resources.limits | nindent 14 }}
              {{- if .gpus }}
              nvidia.com/gpu: {{ .gpus }}
              {{- end }}
          lifecycle:
            {{- include "msaserve.drainLifecycle" $g | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            {{- include "msaserve.baseVolumeMounts" (dict "drain" true) | nindent 12 }}
            {{- if .model }}
            {{- with include "msaserve.modelVolumeMount" $root | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- end }}
            {{- with .mounts }}
            {{- . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "msaserve.baseVolumes" (dict "root" $root "group" $g "drain" true) | nindent 8 }}
        {{- if .model }}
        {{- with include "msaserve.modelVolume" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- with .volumes }}
        {{- . | nindent 8 }}
        {{- end }}
{{- end -}}

{{/* The KV cache group's disk-tier volume (see kvcache.storage.type in values.yaml). */}}
{{- define "msaserve.kvcacheVolume" -}}
{{- $s := .Values.kvcache.storage -}}
- name: kvcache
{{- if eq $s.type "ephemeral" }}
  ephemeral:
    volumeClaimTemplate:
      metadata:
        labels:
          {{- include "msaserve.selectorLabels" . | nindent 10 }}
          app.kubernetes.io/component: kvcache
      spec:
        accessModes:
          {{- toYaml $s.accessModes | nindent 10 }}
        {{- with $s.storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $s.size }}
{{- else if or (eq $s.type "persistentVolumeClaim") (eq $s.type "existingClaim") }}
  persistentVolumeClaim:
    claimName: {{ include "msaserve.kvcacheClaimName" . }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $s.size }}
{{- end }}
{{- end -}}
