{{/*
serveConfigV2: the same document `msaserve deploy-config` renders from a ServeConfig YAML
(msaserve/platform/serve_config_v2.py). Keep the two in step; tests/helm compares them.
*/}}
{{- define "msaserve.serveConfigV2" -}}
{{- $http := .Values.serve.http | default dict -}}
http_options:
  host: {{ dig "host" "127.0.0.1" $http | quote }}
  port: {{ dig "port" 8000 $http | int }}
  request_timeout_s: {{ dig "request_timeout_s" 600.0 $http | float64 }}
applications:
  - name: msaserve
    route_prefix: /
    import_path: msaserve.platform.app:app_builder
    {{- /* JSON (valid YAML) keeps large integers exact; toYaml would print 1.5e+11. */}}
    args: {{ toJson .Values.serve }}
    {{- /* A replica that is stopped (node drain, scale-down, upgrade) finishes its running requests
    first: Serve's default of 20 s would cut a million-token request that may run request_timeout_s. */}}
    deployments:
      {{- range list "Gateway" "Model" }}
      - name: {{ . }}
        graceful_shutdown_timeout_s: {{ dig "request_timeout_s" 600.0 $http | float64 }}
      {{- end }}
{{- end -}}
