"""`msaserve cluster check` logic on real Kubernetes object shapes (no API server runs here).

CRDs are the real KubeRay CRDs deserialized into `V1CustomResourceDefinition` by the client's own
deserializer; RayService statuses are checked against the CRD's status schema before use, so they
have the shape KubeRay writes.
"""

import copy
import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from msaserve.platform.cli.cluster import gather
from msaserve.platform.cluster_check import (
    check_applications,
    check_crds,
    check_gpus,
    check_pods,
    check_rayservice,
    cluster_names,
)


def _crd(doc: dict[str, Any]) -> client.V1CustomResourceDefinition:
    return client.ApiClient().deserialize(json.dumps(doc), "V1CustomResourceDefinition", "application/json")


@pytest.fixture(scope="module")
def crds(crd_documents) -> dict[str, client.V1CustomResourceDefinition]:
    return {
        "rayservices.ray.io": _crd(crd_documents["RayService"]),
        "rayclusters.ray.io": _crd(crd_documents["RayCluster"]),
    }


def _levels(findings) -> list[str]:
    return [f.level for f in findings]


def test_current_kuberay_crds_pass(crds) -> None:
    findings = check_crds(crds)
    assert _levels(findings) == ["ok", "ok", "ok"], [f.line() for f in findings]


def test_missing_crd_says_how_to_install_kuberay(crds) -> None:
    findings = check_crds({**crds, "rayservices.ray.io": None})
    [error] = [f for f in findings if f.level == "error"]
    assert "rayservices.ray.io is not installed" in error.message
    assert "helm install kuberay-operator" in error.message


def test_old_kuberay_crd_is_reported_with_the_version_needed(crd_documents) -> None:
    old = copy.deepcopy(crd_documents["RayService"])
    v1 = next(v for v in old["spec"]["versions"] if v["name"] == "v1")
    spec = v1["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    del spec["rayClusterConfig"]["properties"]["authOptions"]
    del spec["upgradeStrategy"]["properties"]["clusterUpgradeOptions"]
    findings = check_crds({"rayservices.ray.io": _crd(old), "rayclusters.ray.io": None})
    messages = [f.message for f in findings if f.level == "error"]
    assert len(messages) == 3
    assert any("authOptions (KubeRay v1.5.1+" in m and "kubectl apply --server-side" in m for m in messages)
    assert any("clusterUpgradeOptions" in m for m in messages)


def test_crd_without_v1_is_refused(crd_documents) -> None:
    old = copy.deepcopy(crd_documents["RayCluster"])
    old["spec"]["versions"] = [v for v in old["spec"]["versions"] if v["name"] != "v1"]
    findings = check_crds({"rayservices.ray.io": None, "rayclusters.ray.io": _crd(old)})
    assert any("but not ray.io/v1" in f.message for f in findings)


def _node(
    name: str, gpus: str | None, ready: bool = True, taints=(), unschedulable: bool = False
) -> client.V1Node:
    allocatable = {"cpu": "96", "memory": "1500Gi"} | ({"nvidia.com/gpu": gpus} if gpus else {})
    return client.V1Node(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1NodeSpec(taints=list(taints) or None, unschedulable=unschedulable),
        status=client.V1NodeStatus(
            allocatable=allocatable,
            conditions=[client.V1NodeCondition(type="Ready", status="True" if ready else "False")],
        ),
    )


def test_gpus_counted_on_ready_schedulable_nodes_only() -> None:
    taint = client.V1Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule")
    nodes = [
        _node("cpu-1", None),
        _node("gpu-1", "8", taints=[taint]),
        _node("gpu-2", "8", ready=False),
        _node("gpu-3", "4", unschedulable=True),
    ]
    findings = check_gpus(nodes, gpus_per_pod=8)
    lines = [f.line() for f in findings]
    assert _levels(findings) == ["warn", "ok", "warn"], lines
    assert "gpu-2, gpu-3" in findings[0].message
    assert "8 allocatable GPUs on 1 nodes" in findings[1].message
    assert "nvidia.com/gpu=present:NoSchedule" in findings[2].message


def test_no_gpus_points_at_the_device_plugin() -> None:
    [finding] = check_gpus([_node("cpu-1", None), _node("cpu-2", "0")], gpus_per_pod=1)
    assert finding.level == "error" and "NVIDIA device plugin" in finding.message


def test_gpus_per_pod_larger_than_any_node() -> None:
    findings = check_gpus([_node("gpu-1", "4"), _node("gpu-2", "4")], gpus_per_pod=8)
    assert any(f.level == "error" and "largest node has 4" in f.message for f in findings)


def _rayservice(app_status: str, deployments: dict[str, str], ready: bool, upgrading: bool = False) -> dict:
    conditions = [
        {
            "type": "Ready",
            "status": "True" if ready else "False",
            "reason": "RayServiceReady" if ready else "Initializing",
            "message": "" if ready else "the head pod is not ready",
            "lastTransitionTime": "2026-11-29T10:00:00Z",
        },
        {
            "type": "UpgradeInProgress",
            "status": "True" if upgrading else "False",
            "reason": "PendingClusterExists" if upgrading else "NoPendingCluster",
            "message": "",
            "lastTransitionTime": "2026-11-29T10:00:00Z",
        },
    ]
    status = {
        "serviceStatus": "Running" if ready else "",
        "numServeEndpoints": 2 if ready else 0,
        "conditions": conditions,
        "activeServiceStatus": {
            "rayClusterName": "demo-msaserve-abcde",
            "applicationStatuses": {
                "msaserve": {
                    "status": app_status,
                    "message": ""
                    if app_status == "RUNNING"
                    else "Deploying app 'msaserve' failed: ImportError",
                    "serveDeploymentStatuses": {
                        name: {"status": state, "message": "" if state == "HEALTHY" else "replica crashed"}
                        for name, state in deployments.items()
                    },
                }
            },
        },
    }
    if upgrading:
        status["pendingServiceStatus"] = {"rayClusterName": "demo-msaserve-fghij"}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "demo-msaserve"},
        "spec": {"rayClusterConfig": {"headGroupSpec": {"template": {"spec": {"containers": []}}}}},
        "status": status,
    }


def test_statuses_have_the_crd_shape(crd_validators) -> None:
    for obj in (
        _rayservice("RUNNING", {"Gateway": "HEALTHY"}, True),
        _rayservice("DEPLOY_FAILED", {"Model": "UNHEALTHY"}, False, upgrading=True),
    ):
        assert list(crd_validators["RayService"].iter_errors(obj)) == []


def test_healthy_rayservice() -> None:
    obj = _rayservice("RUNNING", {"Gateway": "HEALTHY", "Model": "HEALTHY"}, ready=True)
    findings = check_rayservice(obj, "ml", "demo-msaserve") + check_applications(obj)
    assert _levels(findings) == ["ok", "ok"], [f.line() for f in findings]
    assert cluster_names(obj) == ["demo-msaserve-abcde"]


def test_failed_application_names_the_deployment_and_message() -> None:
    obj = _rayservice(
        "DEPLOY_FAILED", {"Gateway": "HEALTHY", "Model": "UNHEALTHY"}, ready=False, upgrading=True
    )
    findings = check_rayservice(obj, "ml", "demo-msaserve") + check_applications(obj)
    lines = [f.line() for f in findings]
    assert any("not Ready (Initializing): the head pod is not ready" in line for line in lines)
    assert any("pending cluster demo-msaserve-fghij" in line for line in lines)
    assert any("no Serve endpoints" in line for line in lines)
    assert any(
        "msaserve is DEPLOY_FAILED: Deploying app 'msaserve' failed: ImportError" in line for line in lines
    )
    assert any("deployment Model is UNHEALTHY: replica crashed" in line for line in lines)
    assert not any("Gateway" in line for line in lines)
    assert cluster_names(obj) == ["demo-msaserve-abcde", "demo-msaserve-fghij"]


def test_missing_rayservice_says_how_to_install() -> None:
    [finding] = check_rayservice(None, "ml", "demo")
    assert "helm install demo helm/msaserve -n ml" in finding.message
    assert check_applications(None) == []


def test_unschedulable_and_crashing_pods() -> None:
    pending = client.V1Pod(
        metadata=client.V1ObjectMeta(name="demo-gpu-worker-x"),
        status=client.V1PodStatus(
            conditions=[
                client.V1PodCondition(
                    type="PodScheduled",
                    status="False",
                    reason="Unschedulable",
                    message="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                )
            ]
        ),
    )
    waiting = client.V1ContainerStateWaiting(reason="ImagePullBackOff", message="pull access denied")
    crashing = client.V1Pod(
        metadata=client.V1ObjectMeta(name="demo-head-y"),
        status=client.V1PodStatus(
            container_statuses=[
                client.V1ContainerStatus(
                    name="ray-head",
                    image="i",
                    image_id="",
                    ready=False,
                    restart_count=3,
                    state=client.V1ContainerState(waiting=waiting),
                )
            ]
        ),
    )
    running = client.V1Pod(
        metadata=client.V1ObjectMeta(name="ok"), status=client.V1PodStatus(phase="Running")
    )
    lines = [f.line() for f in check_pods([pending, crashing, running])]
    assert len(lines) == 2
    assert "Insufficient nvidia.com/gpu" in lines[0] and "lower gpuWorkers.gpusPerPod" in lines[0]
    assert "demo-head-y/ray-head: ImagePullBackOff: pull access denied" in lines[1]


class _FakeKubernetes:
    """Stands in for the `kubernetes.client` module: the APIs gather() calls, answering with models."""

    def __init__(self, crds, nodes, rayservice, pods) -> None:
        self._crds, self._nodes, self._rayservice, self._pods = crds, nodes, rayservice, pods
        self.selectors: list[str] = []

    def ApiextensionsV1Api(self):  # named like the client class it stands in for
        fake = self

        class Api:
            def read_custom_resource_definition(self, name):
                if fake._crds.get(name) is None:
                    raise ApiException(status=404, reason="Not Found")
                return fake._crds[name]

        return Api()

    def CoreV1Api(self):
        fake = self

        class Api:
            def list_node(self):
                return client.V1NodeList(items=fake._nodes)

            def list_namespaced_pod(self, namespace, label_selector):
                fake.selectors.append(label_selector)
                return client.V1PodList(items=fake._pods)

        return Api()

    def CustomObjectsApi(self):
        fake = self

        class Api:
            def get_namespaced_custom_object(self, group, version, namespace, plural, name):
                if fake._rayservice is None:
                    raise ApiException(status=404, reason="Not Found")
                return fake._rayservice

        return Api()


def test_gather_runs_every_check(crds) -> None:
    obj = _rayservice("RUNNING", {"Model": "HEALTHY"}, ready=True)
    fake = _FakeKubernetes(crds, [_node("gpu-1", "8")], obj, [])
    findings = gather(fake, "ml", "demo-msaserve", gpus_per_pod=1)
    assert {f.check for f in findings} == {"crds", "gpus", "rayservice", "serve"}
    assert all(f.level == "ok" for f in findings), [f.line() for f in findings]
    assert fake.selectors == ["ray.io/cluster in (demo-msaserve-abcde)"]


def test_gather_without_kuberay_reports_instead_of_raising() -> None:
    fake = _FakeKubernetes({}, [], None, [])
    findings = gather(fake, "ml", "demo", gpus_per_pod=0)
    errors = [f for f in findings if f.level == "error"]
    assert [f.check for f in errors] == ["crds", "crds", "rayservice"]
