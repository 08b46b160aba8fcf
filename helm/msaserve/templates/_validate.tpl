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
{{- /* A replica of tensor_parallel_size x expert_parallel_size > 1 ranks reserves one GPU per rank in
its placement group (msaserve/platform/model_placement.py); the replica actor itself holds none. */ -}}
{{- $ranks := mul (dig "engine" "tensor_parallel_size" 1 $serve | int) (dig "engine" "expert_parallel_size" 1 $serve | int) -}}
{{- if gt $ranks 1 -}}
{{- if gt $gpus 0.0 -}}
{{- fail (printf "serve.engine.tensor_parallel_size x expert_parallel_size = %d: each model replica reserves its %d GPUs in a placement group (one bundle per rank) and the replica itself holds none; set serve.deployments.model.ray_actor_options.num_gpus: 0" $ranks $ranks) -}}
{{- end -}}
{{- if eq $device "cuda" -}}
{{- $gpus = float64 $ranks -}}
{{- end -}}
{{- end -}}
{{- if .Values.gpuWorkers.enabled -}}
{{- if eq $gpus 0.0 -}}
{{- fail "gpuWorkers.enabled is true but serve.deployments.model.ray_actor_options.num_gpus is 0: the GPUs would sit idle; set num_gpus (e.g. 1) and serve.model.device: cuda, or gpuWorkers.enabled: false" -}}
{{- end -}}
{{- if gt $gpus (float64 .Values.gpuWorkers.gpusPerPod) -}}
{{- fail (printf "serve.deployments.model.ray_actor_options.num_gpus=%v (or tensor_parallel_size x expert_parallel_size GPUs) is more than gpuWorkers.gpusPerPod=%v: no GPU pod could hold a model replica" $gpus .Values.gpuWorkers.gpusPerPod) -}}
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
{{- include "msaserve.validateDay2" . -}}
{{- include "msaserve.validateSite" . -}}
{{- end -}}

{{/* Drains, placement and QoS: what keeps upgrades, node drains and memory pressure from cutting sessions. */}}
{{- define "msaserve.validateDay2" -}}
{{- $serve := .Values.serve -}}
{{- $timeout := dig "http" "request_timeout_s" 600.0 $serve | float64 -}}
{{- range $name := list "cpuWorkers" "gpuWorkers" -}}
{{- $g := index $.Values $name -}}
{{- $budget := include "msaserve.drainBudget" $g | float64 -}}
{{- if lt $budget $timeout -}}
{{- fail (printf "%s.terminationGracePeriodSeconds=%v leaves the preStop drain %v s (60 s go to ray stop) but serve.http.request_timeout_s is %v: running requests would be cut; set it to at least %v" $name $g.terminationGracePeriodSeconds $budget $timeout (add 60 (ceil $timeout | int))) -}}
{{- end -}}
{{- end -}}
{{- if lt (float64 .Values.upgradeStrategy.oldClusterDeletionDelaySeconds) $timeout -}}
{{- fail (printf "upgradeStrategy.oldClusterDeletionDelaySeconds=%v is less than serve.http.request_timeout_s=%v: KubeRay would delete the old cluster while its requests still run; set it to at least %v" .Values.upgradeStrategy.oldClusterDeletionDelaySeconds $timeout (ceil $timeout | int)) -}}
{{- end -}}
{{- $egress := .Values.networkPolicy.egress -}}
{{- if and .Values.networkPolicy.enabled $egress.enabled (not $egress.to) (or .Values.autoscaler.enabled .Values.gcsFaultTolerance.enabled (eq .Values.model.source "download")) -}}
{{- fail "networkPolicy.egress.enabled with an empty networkPolicy.egress.to: the autoscaler sidecar (Kubernetes API), the GCS's Redis or the model download could not reach their destination; list them in networkPolicy.egress.to" -}}
{{- end -}}
{{- if and .Values.gcsFaultTolerance.enabled (not .Values.gcsFaultTolerance.redisAddress) -}}
{{- fail "gcsFaultTolerance.enabled is true: set gcsFaultTolerance.redisAddress (host:port of the external Redis that keeps the GCS tables)" -}}
{{- end -}}
{{- if and .Values.podDisruptionBudget.enabled (eq (toString .Values.podDisruptionBudget.head.maxUnavailable) "0") -}}
{{- fail "podDisruptionBudget.head.maxUnavailable is 0: the head pod could never be evicted and every `kubectl drain` of its node would hang; set it to 1 and turn on gcsFaultTolerance so that a head restart keeps the replicas" -}}
{{- end -}}
{{- $groups := list (list "kvcache" .Values.kvcache.enabled) (list "gpuWorkers" .Values.gpuWorkers.enabled) -}}
{{- range $groups -}}
{{- $name := index . 0 -}}
{{- $g := index $.Values $name -}}
{{- if and (index . 1) (not (hasKey ($g.rayStartParams | default dict) "num-cpus")) -}}
{{- fail (printf "%s.rayStartParams has no num-cpus: Ray would advertise the pod's CPU limit and place gateway, preprocess and task work on it; set %s.rayStartParams.num-cpus" $name $name) -}}
{{- end -}}
{{- end -}}
{{- if .Values.gpuWorkers.enabled -}}
{{- $g := .Values.gpuWorkers -}}
{{- $opts := dig "deployments" "model" "ray_actor_options" dict $serve -}}
{{- $ranks := mul (dig "engine" "tensor_parallel_size" 1 $serve | int) (dig "engine" "expert_parallel_size" 1 $serve | int) -}}
{{- $perReplica := dig "num_gpus" 1.0 $opts | float64 -}}
{{- $cpus := dig "num_cpus" 1.0 $opts | float64 -}}
{{- if gt $ranks 1 -}}
{{- $perReplica = float64 $ranks -}}
{{- $cpus = addf $cpus (float64 $ranks) -}}{{- /* the driver, then a CPU per rank bundle */ -}}
{{- end -}}
{{- $perPod := divf (float64 $g.gpusPerPod) $perReplica | floor -}}
{{- $needed := mulf $perPod $cpus -}}
{{- if lt (float64 (index $g.rayStartParams "num-cpus")) $needed -}}
{{- fail (printf "gpuWorkers.rayStartParams.num-cpus=%v but the %v model replicas of a GPU pod ask for %v CPUs (serve.deployments.model.ray_actor_options.num_cpus): they could not all start; raise num-cpus" (index $g.rayStartParams "num-cpus") $perPod $needed) -}}
{{- end -}}
{{- $pods := list (list "gpuWorkers.resources" $g.resources) -}}
{{- if eq .Values.model.source "download" -}}
{{- $pods = append $pods (list "model.download.resources" .Values.model.download.resources) -}}
{{- end -}}
{{- range $pods -}}
{{- $where := index . 0 -}}
{{- $r := index . 1 -}}
{{- range $kind := list "cpu" "memory" -}}
{{- if ne (toString (index $r.requests $kind)) (toString (index $r.limits $kind)) -}}
{{- fail (printf "%s: requests.%s=%v differs from limits.%s=%v; GPU pods must be Guaranteed (requests = limits for every container) or the kubelet evicts them first under memory pressure; make them equal" $where $kind (index $r.requests $kind) $kind (index $r.limits $kind)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* What only the site can give: the image and the Secrets (last, so the checks above speak first). */}}
{{- define "msaserve.validateSite" -}}
{{- if or (not .Values.image.repository) (and (not .Values.image.tag) (not .Values.image.digest)) -}}
{{- fail (printf "image.repository=%q image.tag=%q: msaserve publishes no image. Build the repository's Dockerfile, push it to a registry your nodes pull from (docker build -t REGISTRY/msaserve:0.1.0 . && docker push REGISTRY/msaserve:0.1.0) and set image.repository and image.tag (or image.digest)" .Values.image.repository .Values.image.tag) -}}
{{- end -}}
{{- $k := .Values.apiKeys -}}
{{- if and $k.enabled (not $k.existingSecret) (not $k.keys) (not $k.generate) -}}
{{- fail "apiKeys.enabled is true but no keys are given: set apiKeys.existingSecret to a Secret with the keys under apiKeys.secretKey (kubectl create secret generic, or an ExternalSecret), or apiKeys.keys, or apiKeys.generate: true (Helm CLI only: a GitOps tool would change the key on every sync)" -}}
{{- end -}}
{{- if and $k.enabled (not $k.existingSecret) $k.keys $k.generate -}}
{{- fail "apiKeys.keys and apiKeys.generate are both set: keep one" -}}
{{- end -}}
{{- $a := .Values.rayAuth -}}
{{- if and (eq $a.mode "token") (not $a.existingSecret) (not $a.generate) -}}
{{- fail "rayAuth.mode is token but no token is given: set rayAuth.existingSecret to a Secret with key auth_token (kubectl create secret generic NAME --from-literal=auth_token=$(openssl rand -hex 32), or an ExternalSecret), or rayAuth.generate: true (Helm CLI only)" -}}
{{- end -}}
{{- if $k.enabled -}}
{{- $pinned := dig "deployments" "gateway" "ray_actor_options" "resources" dict .Values.serve -}}
{{- $cpuOnly := list -}}
{{- range $r, $_ := .Values.cpuWorkers.rayResources -}}
{{- if and (hasKey $pinned $r) (not (hasKey ($.Values.gpuWorkers.rayResources | default dict) $r)) (not (hasKey ($.Values.kvcache.rayResources | default dict) $r)) -}}
{{- $cpuOnly = append $cpuOnly $r -}}
{{- end -}}
{{- end -}}
{{- if not $cpuOnly -}}
{{- fail (printf "apiKeys.enabled is true but serve.deployments.gateway.ray_actor_options.resources (%v) names none of the CPU group's own rayResources (%v): the gateway could start on a pod without MSASERVE_API_KEYS (only the CPU group's pods hold it); set serve.deployments.gateway.ray_actor_options.resources: {msaserve_cpu_group: 1}" $pinned .Values.cpuWorkers.rayResources) -}}
{{- end -}}
{{- end -}}
{{- end -}}
