{{/*
Checks that need more than one value (values.schema.json checks each value alone). Each message
names the values involved and what to change. serve_config_v2.cluster_problems() applies the
same rules to a ServeConfig in `msaserve deploy-config`.
*/}}
{{- define "msaserve.validate" -}}
{{- $serve := .Values.serve -}}
{{- $host := dig "http" "host" "127.0.0.1" $serve -}}
{{- if has $host (list "127.0.0.1" "localhost" "::1") -}}
{{- fail (printf "serve.http.host is %q: the Serve proxy would only listen inside its pod and KubeRay's API Service would get no traffic; set serve.http.host: 0.0.0.0" $host) -}}
{{- end -}}
{{- if .Values.apiKeys.enabled -}}
{{- $env := dig "auth" "api_keys_env" "" $serve -}}
{{- if ne $env "MSASERVE_API_KEYS" -}}
{{- fail (printf "apiKeys.enabled is true but serve.auth.api_keys_env is %q: the keys in Secret %s reach the gateway as MSASERVE_API_KEYS and would be ignored (the API would be open); set serve.auth.api_keys_env: MSASERVE_API_KEYS" $env (include "msaserve.apiKeysSecretName" .)) -}}
{{- end -}}
{{- end -}}
{{- $gpus := dig "deployments" "model" "ray_actor_options" "num_gpus" 0 $serve | float64 -}}
{{- $device := dig "model" "device" "cpu" $serve -}}
{{- if .Values.gpuWorkers.enabled -}}
{{- if eq $gpus 0.0 -}}
{{- fail "gpuWorkers.enabled is true but serve.deployments.model.ray_actor_options.num_gpus is 0: the GPUs would sit idle; set num_gpus (e.g. 1) and serve.model.device: cuda, or gpuWorkers.enabled: false" -}}
{{- end -}}
{{- if gt $gpus (float64 .Values.gpuWorkers.gpusPerPod) -}}
{{- fail (printf "serve.deployments.model.ray_actor_options.num_gpus=%v is more than gpuWorkers.gpusPerPod=%v: no GPU pod could hold a model replica" $gpus .Values.gpuWorkers.gpusPerPod) -}}
{{- end -}}
{{- else if gt $gpus 0.0 -}}
{{- fail (printf "serve.deployments.model.ray_actor_options.num_gpus=%v but gpuWorkers.enabled is false: no pod has a GPU, so the model replicas could never start" $gpus) -}}
{{- end -}}
{{- if and (eq $device "cuda") (eq $gpus 0.0) -}}
{{- fail "serve.model.device is cuda but serve.deployments.model.ray_actor_options.num_gpus is 0: Ray would give the replica no GPU; set num_gpus > 0 or serve.model.device: cpu" -}}
{{- end -}}
{{- $diskBytes := dig "kvcache" "disk_bytes" 0 $serve | float64 -}}
{{- if gt $diskBytes 0.0 -}}
{{- $diskPath := dig "kvcache" "disk_path" "" $serve -}}
{{- if not .Values.kvcache.enabled -}}
{{- fail "serve.kvcache.disk_bytes > 0 needs the KV cache group's volume: set kvcache.enabled: true or serve.kvcache.disk_bytes: 0" -}}
{{- end -}}
{{- if ne $diskPath .Values.kvcache.storage.mountPath -}}
{{- fail (printf "serve.kvcache.disk_path is %q but the KV cache volume is mounted at kvcache.storage.mountPath=%q; make them equal" $diskPath .Values.kvcache.storage.mountPath) -}}
{{- end -}}
{{- end -}}
{{- $m := .Values.model -}}
{{- if and (eq $m.source "pvc") (not $m.pvc.claimName) -}}
{{- fail "model.source is pvc: set model.pvc.claimName to the PersistentVolumeClaim holding the model" -}}
{{- end -}}
{{- if and (eq $m.source "hostPath") (not $m.hostPath.path) -}}
{{- fail "model.source is hostPath: set model.hostPath.path to the model directory on the nodes" -}}
{{- end -}}
{{- if and (eq $m.source "download") (not $m.download.repoId) -}}
{{- fail "model.source is download: set model.download.repoId (a Hugging Face repository, e.g. HuggingFaceTB/SmolLM2-135M-Instruct)" -}}
{{- end -}}
{{- $spec := dig "model" "spec" "smollm2" $serve | toString -}}
{{- if and (ne $m.source "image") (not (hasPrefix (printf "%s/" $m.mountPath) $spec)) -}}
{{- fail (printf "model.source is %s (mounted at %s) but serve.model.spec is %q; point serve.model.spec at the model under %s/ or set model.source: image" $m.source $m.mountPath $spec $m.mountPath) -}}
{{- end -}}
{{- range $name := list "cpuWorkers" "kvcache" "gpuWorkers" -}}
{{- $g := index $.Values $name -}}
{{- if or (gt (int $g.minReplicas) (int $g.replicas)) (gt (int $g.replicas) (int $g.maxReplicas)) -}}
{{- fail (printf "%s: need minReplicas (%v) <= replicas (%v) <= maxReplicas (%v)" $name $g.minReplicas $g.replicas $g.maxReplicas) -}}
{{- end -}}
{{- end -}}
{{- $s := .Values.kvcache.storage -}}
{{- if and .Values.kvcache.enabled (eq $s.type "persistentVolumeClaim") (gt (int .Values.kvcache.maxReplicas) 1) (not (has "ReadWriteMany" $s.accessModes)) -}}
{{- fail (printf "kvcache.storage.type is persistentVolumeClaim with accessModes %v but kvcache.maxReplicas is %v: pods on different nodes cannot share a ReadWriteOnce volume; use ReadWriteMany, maxReplicas: 1 or type: ephemeral" $s.accessModes .Values.kvcache.maxReplicas) -}}
{{- end -}}
{{- if and .Values.kvcache.enabled (eq $s.type "existingClaim") (not $s.existingClaim) -}}
{{- fail "kvcache.storage.type is existingClaim: set kvcache.storage.existingClaim" -}}
{{- end -}}
{{- if and (eq .Values.upgradeStrategy.type "NewClusterWithIncrementalUpgrade") (not .Values.upgradeStrategy.incremental.gatewayClassName) -}}
{{- fail "upgradeStrategy.type NewClusterWithIncrementalUpgrade routes traffic through a Gateway: set upgradeStrategy.incremental.gatewayClassName (Gateway API must be installed)" -}}
{{- end -}}
{{- end -}}
