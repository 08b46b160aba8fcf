"""What the values do: groups, GPUs, storage, model sources, security defaults, and refusals.

Bad values must be refused before anything reaches a cluster, either by values.schema.json (one
value at a time) or by templates/_validate.tpl (rules over several values), with a message that
names the values.
"""

import re
from typing import Any

import helm_python
import pytest
import yaml
from helm_chart import load_values, with_site


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def _groups(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cluster = _one(docs, "RayService")["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def _all_containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


@pytest.mark.parametrize("values_name", ["default", "gpu", "minimal", "all-features", "m3"])
def test_security_and_resources_on_every_container(rendered, values_name: str) -> None:
    cluster = _one(rendered[values_name], "RayService")["spec"]["rayClusterConfig"]
    autoscaler = cluster["enableInTreeAutoscaling"]
    for name, group in _groups(rendered[values_name]).items():
        spec = group["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        # Only the head runs a Kubernetes client: KubeRay's autoscaler sidecar, when it is on.
        assert spec["automountServiceAccountToken"] is (name == "head" and autoscaler), name
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["tmp"] and volumes["dshm"]["emptyDir"]["medium"] == "Memory", name
        for container in _all_containers(spec):
            where = f"{name}/{container['name']}"
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), where
            assert {"cpu", "memory"} <= container["resources"]["limits"].keys(), where
            assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, where


def test_default_groups_and_head_has_no_gpu(rendered) -> None:
    groups = _groups(rendered["default"])
    assert list(groups) == ["head", "cpu", "kvcache", "gpu"]
    head = groups["head"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no replicas on the head
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    ports = {p["name"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {"dashboard", "gcs-server", "serve", "metrics"} <= ports
    # The GCS's task-event buffer is capped (Ray's default let it grow 250 MiB in a soak).
    env = {e["name"]: e.get("value") for e in head["template"]["spec"]["containers"][0]["env"]}
    assert env["RAY_task_events_max_num_task_in_gcs"] == "10000"
    assert groups["kvcache"]["resources"] == {"msaserve_kvcache_group": "1000"}
    # API traffic stays off the head, which holds the GCS and the Serve controller.
    assert _one(rendered["default"], "RayService")["spec"]["excludeHeadPodFromServeSvc"] is True


def test_gpu_group_from_values(rendered) -> None:
    values = load_values("gpu")["gpuWorkers"]
    gpu = _groups(rendered["gpu"])["gpu"]
    assert (gpu["minReplicas"], gpu["replicas"], gpu["maxReplicas"]) == (1, 1, 4)
    spec = gpu["template"]["spec"]
    resources = spec["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 8
    assert spec["tolerations"] == values["tolerations"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert spec["affinity"] == values["affinity"]
    model = {v["name"]: v for v in spec["volumes"]}["model"]
    assert model["persistentVolumeClaim"] == {"claimName": "models-rwx", "readOnly": True}
    mount = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}["model"]
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "minimax"}


def test_minimal_renders_only_what_it_needs(rendered) -> None:
    docs = rendered["minimal"]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "RayService", "ServiceAccount"]  # + drain script
    rayservice = _one(docs, "RayService")["spec"]
    assert [g["groupName"] for g in rayservice["rayClusterConfig"]["workerGroupSpecs"]] == ["cpu"]
    assert rayservice["rayClusterConfig"]["authOptions"] == {"mode": "disabled"}
    assert rayservice["rayClusterConfig"]["enableInTreeAutoscaling"] is False
    env = rayservice["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    assert "MSASERVE_API_KEYS" not in {e["name"] for e in env}


def test_all_features_objects_are_wired_together(rendered) -> None:
    docs = rendered["all-features"]
    kinds = sorted(d["kind"] for d in docs)
    assert "Secret" not in kinds  # both Secrets are existing ones
    rayservice = _one(docs, "RayService")["spec"]
    api = rayservice["serveService"]
    ingress = _one(docs, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == api["metadata"]["name"] == "msa-prod-api"
    assert backend["port"]["name"] in {p["name"] for p in api["spec"]["ports"]}
    assert rayservice["upgradeStrategy"] == {
        "type": "NewClusterWithIncrementalUpgrade",
        "clusterUpgradeOptions": {
            "gatewayClassName": "istio",
            "stepSizePercent": 20,
            "intervalSeconds": 120,
            "maxSurgePercent": 20,
        },
    }
    assert rayservice["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    pvc = _one(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    groups = _groups(docs)
    kv_volumes = {v["name"]: v for v in groups["kvcache"]["template"]["spec"]["volumes"]}
    assert kv_volumes["kvcache"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    for name in ("cpu", "gpu"):
        spec = groups[name]["template"]["spec"]
        [init] = spec["initContainers"]
        env = {e["name"]: e for e in init["env"]}
        assert env["REPO_ID"]["value"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert env["TARGET"]["value"] == "/models/smollm2"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    cpu_env = {e["name"]: e for e in groups["cpu"]["template"]["spec"]["containers"][0]["env"]}
    keys = cpu_env["MSASERVE_API_KEYS"]
    assert keys["valueFrom"]["secretKeyRef"] == {"name": "msaserve-keys", "key": "keys"}
    assert "initContainers" not in groups["kvcache"]["template"]["spec"]  # it never reads the model
    [dashboard_cm] = [d for d in docs if d["kind"] == "ConfigMap" and "msaserve.json" in d["data"]]
    assert dashboard_cm["metadata"]["namespace"] == "monitoring"
    assert dashboard_cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_generated_secrets_only_when_asked(render) -> None:
    """generate: true (Helm CLI) makes both Secrets; the default names existing ones and makes none."""
    generated = {"existingSecret": "", "generate": True}
    docs = render({"apiKeys": generated, "rayAuth": generated})
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert set(secrets) == {"demo-msaserve-api-keys", "demo-msaserve-ray-token"}
    assert set(secrets["demo-msaserve-ray-token"]["data"]) == {"auth_token"}
    rayservice = _one(docs, "RayService")["spec"]
    assert rayservice["rayClusterConfig"]["authOptions"]["secretName"] == "demo-msaserve-ray-token"


def test_multi_gpu_replica_renders_its_pod_and_args(render) -> None:
    """TP 2 × EP 2: a pod of 4 GPUs holds the replica (num_gpus 0: its placement group reserves
    them); its CPUs cover the driver's 4 and a CPU per rank."""
    engine = {"tensor_parallel_size": 2, "expert_parallel_size": 2}
    no_gpu = {"model": {"ray_actor_options": {"num_gpus": 0}}}
    docs = render({"gpuWorkers": {"gpusPerPod": 4, "rayStartParams": {"num-cpus": "8"}},
                   "serve": {"engine": engine, "deployments": no_gpu}})
    gpu = _groups(docs)["gpu"]["template"]["spec"]["containers"][0]["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == 4
    serve = yaml.safe_load(_one(docs, "RayService")["spec"]["serveConfigV2"])
    assert serve["applications"][0]["args"]["engine"] == engine


@pytest.mark.parametrize(
    ("storage", "expected"),
    [
        ({"type": "ephemeral", "storageClassName": "fast"}, "ephemeral"),
        ({"type": "existingClaim", "existingClaim": "kv-disk"}, "persistentVolumeClaim"),
        ({"type": "emptyDir"}, "emptyDir"),
    ],
)
def test_kvcache_storage_modes(render, storage: dict[str, Any], expected: str) -> None:
    docs = render({"kvcache": {"storage": storage}})
    kv = _groups(docs)["kvcache"]["template"]["spec"]
    volume = {v["name"]: v for v in kv["volumes"]}["kvcache"]
    assert set(volume) == {"name", expected}
    if expected == "ephemeral":
        claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert claim["storageClassName"] == "fast"
        assert claim["resources"]["requests"]["storage"] == "200Gi"
    if expected == "persistentVolumeClaim":
        assert volume["persistentVolumeClaim"]["claimName"] == "kv-disk"
    mount = {m["name"]: m for m in kv["containers"][0]["volumeMounts"]}["kvcache"]
    assert mount["mountPath"] == "/var/lib/msaserve/kvcache"
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]


def test_network_policy_limits_the_dashboard_and_kv_cache(rendered) -> None:
    docs = rendered["all-features"]
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    head, kv = policies["msa-prod-head"], policies["msa-prod-kvcache"]
    assert head["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "head"
    dashboard_rules = [r for r in head["ingress"] if {"port": 8265, "protocol": "TCP"} in r.get("ports", [])]
    [rule] = dashboard_rules
    namespaces = [p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in rule["from"]]
    assert namespaces == ["ray-system", "ops"]
    for policy in (head, kv):
        assert all("from" in rule for rule in policy["ingress"])  # no rule open to everyone here
    assert not [r for r in kv["ingress"] if {"port": 8265, "protocol": "TCP"} in r.get("ports", [])]
    # Every Ray pod of the release matches the in-release peer, so Ray's own traffic is allowed.
    peer = head["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    for name, group in _groups(docs).items():
        assert peer.items() <= group["template"]["metadata"]["labels"].items(), name


SCHEMA_REFUSALS = [
    ({"gpuWorkers": {"gpusPerPod": 0}}, "/gpuWorkers/gpusPerPod"),
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"gpuWorker": {"enabled": True}}, "'gpuWorker' not allowed"),
    ({"upgradeStrategy": {"type": "Rolling"}}, "/upgradeStrategy/type"),
    ({"head": {"resources": {"limits": None}}}, "limits"),
    ({"cpuWorkers": {"resources": {"requests": {"cpu": "lots"}}}}, "/cpuWorkers/resources/requests/cpu"),
    ({"apiKeys": {"keys": ["short"]}}, "/apiKeys/keys/0"),
    ({"kvcache": {"storage": {"accessModes": ["ReadWriteSometimes"]}}}, "/kvcache/storage/accessModes/0"),
    ({"serve": {"engine": {"max_num_seqs": 0}}}, "/serve/engine/max_num_seqs"),
    ({"serve": {"modle": {"spec": "tiny"}}}, "'modle' not allowed"),
    ({"serve": {"router": {"policy": "random"}}}, "/serve/router/policy"),
    ({"kvcache": {"terminationGracePeriodSeconds": 30}}, "/kvcache/terminationGracePeriodSeconds"),
    ({"gcsFaultTolerance": {"redisAdress": "r:6379"}}, "'redisAdress' not allowed"),
    ({"networkPolicy": {"egress": {"to": {"cidr": "10.0.0.0/8"}}}}, "/networkPolicy/egress/to"),
]


@pytest.mark.parametrize(("values", "where"), SCHEMA_REFUSALS)
def test_values_schema_refuses_bad_values(chart, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as refused:
        chart.render(values=values, name="demo", namespace="ml", is_install=True)
    assert where in str(refused.value)


TEMPLATE_REFUSALS = [
    ({"serve": {"http": {"host": "127.0.0.1"}}}, "set serve.http.host: 0.0.0.0"),
    ({"serve": {"auth": {"api_keys_env": "KEYS"}}}, "set serve.auth.api_keys_env: MSASERVE_API_KEYS"),
    ({"serve": {"deployments": {"model": {"ray_actor_options": {"num_gpus": 0}}}}}, "GPUs would sit idle"),
    ({"gpuWorkers": {"enabled": False}}, "gpuWorkers.enabled is false"),
    (
        {"serve": {"deployments": {"model": {"ray_actor_options": {"num_gpus": 2}}}}},
        "gpuWorkers.gpusPerPod=1",
    ),
    (  # a 2-GPU replica (tensor parallel) reserves its GPUs in a placement group, not num_gpus
        {"serve": {"engine": {"tensor_parallel_size": 2}}},
        "set serve.deployments.model.ray_actor_options.num_gpus: 0",
    ),
    (
        {"serve": {"engine": {"tensor_parallel_size": 2},
                   "deployments": {"model": {"ray_actor_options": {"num_gpus": 0}}}}},
        "gpuWorkers.gpusPerPod=1",
    ),
    (
        {"gpuWorkers": {"gpusPerPod": 2},
         "serve": {"engine": {"expert_parallel_size": 2},
                   "deployments": {"model": {"ray_actor_options": {"num_gpus": 0}}}}},
        "gpuWorkers.rayStartParams.num-cpus=4",
    ),
    ({"kvcache": {"storage": {"mountPath": "/data"}}}, "make them equal"),
    ({"model": {"source": "pvc"}}, "set model.pvc.claimName"),
    (
        {"model": {"source": "download", "download": {"repoId": "org/m"}}},
        "point serve.model.spec at the model",
    ),
    ({"gpuWorkers": {"minReplicas": 3}}, "gpuWorkers: need minReplicas (3) <= replicas (1)"),
    (
        {"kvcache": {"maxReplicas": 2, "storage": {"type": "persistentVolumeClaim"}}},
        "cannot share a ReadWriteOnce volume",
    ),
    ({"upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade"}}, "set upgradeStrategy.incremental"),
]


@pytest.mark.parametrize(("values", "message"), TEMPLATE_REFUSALS)
def test_templates_refuse_inconsistent_values(chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(values=with_site(values), name="demo", namespace="ml", is_install=True)
    assert message in str(refused.value)


def test_notes_say_how_to_reach_api_and_dashboard(chart) -> None:
    notes = chart.render(values=with_site({}), name="demo", namespace="ml", is_install=True)[
        "msaserve/templates/NOTES.txt"
    ]
    assert "port-forward svc/demo-msaserve-api 8000:8000" in notes
    assert "port-forward svc/demo-msaserve-head-svc 8265:8265" in notes  # KubeRay's, follows the active head
    assert "secret msaserve-ray-token -o jsonpath='{.data.auth_token}'" in notes
    assert "secret msaserve-api-keys" in notes
    assert "gcsFaultTolerance is off" in notes


def test_names_fit_kubernetes_limits_for_the_longest_release_name(chart) -> None:
    """Helm allows 53-character release names; KubeRay appends a suffix to the RayService name."""
    release = "r" * 53
    out = chart.render(values=with_site({}), name=release, namespace="ml", is_install=True)
    docs = [
        d
        for path, text in out.items()
        if not path.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d
    ]
    dns_label = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    names = [d["metadata"]["name"] for d in docs]
    names.append(_one(docs, "RayService")["spec"]["serveService"]["metadata"]["name"])
    names.append(_one(docs, "RayService")["metadata"]["name"] + "-head-svc")  # KubeRay's dashboard Service
    for name in names:
        assert len(name) <= 63 and dns_label.match(name), name
    assert len(_one(docs, "RayService")["metadata"]["name"]) <= 40


@pytest.mark.parametrize(
    ("model", "volume"),
    [
        (
            {"source": "hostPath", "hostPath": {"path": "/mnt/models"}},
            {"hostPath": {"path": "/mnt/models", "type": "Directory"}},
        ),
        (
            {"source": "pvc", "pvc": {"claimName": "weights"}},
            {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
        ),
    ],
)
def test_model_sources_mount_read_only_on_model_readers(
    render, model: dict[str, Any], volume: dict[str, Any]
) -> None:
    docs = render({"model": model, "serve": {"model": {"spec": "/models/m"}}})
    groups = _groups(docs)
    for name in ("cpu", "gpu"):
        spec = groups[name]["template"]["spec"]
        assert {v["name"]: v for v in spec["volumes"]}["model"] == {"name": "model", **volume}, name
        mount = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}["model"]
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}, name
        assert "initContainers" not in spec
    for name in ("head", "kvcache"):
        assert "model" not in {v["name"] for v in groups[name]["template"]["spec"]["volumes"]}, name
