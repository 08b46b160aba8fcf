"""`msaserve cluster check`: is this Kubernetes cluster ready for (and running) the msaserve chart?

The checks are pure functions over the `kubernetes` client's objects (`V1CustomResourceDefinition`,
`V1Node`, `V1Pod`) and the RayService as the dict the CustomObjectsApi returns, so they are tested
on real object shapes without an API server. `gather` is the only code that talks to the cluster.
Every finding that is not OK says what to do next.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes.client import V1CustomResourceDefinition, V1JSONSchemaProps, V1Node, V1Pod
from kubernetes.utils import parse_quantity

GPU_RESOURCE = "nvidia.com/gpu"
REQUIRED_CRDS = ("rayservices.ray.io", "rayclusters.ray.io")
APP_NAME = "msaserve"
INSTALL_KUBERAY = (
    "helm repo add kuberay https://ray-project.github.io/kuberay-helm/ && "
    "helm install kuberay-operator kuberay/kuberay-operator -n kuberay-system --create-namespace "
    "--version 1.7.0"
)
# Fields of the RayService CRD that the chart uses, with the KubeRay release that added them.
CRD_FEATURES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("spec", "rayClusterConfig", "authOptions"), "v1.5.1", "rayAuth (Ray token auth)"),
    (("spec", "upgradeStrategy", "clusterUpgradeOptions"), "v1.5.1", "NewClusterWithIncrementalUpgrade"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", "resources"), "v1.5.0", "groups' rayResources"),
)

Level = Literal["ok", "warn", "error"]


@dataclass(frozen=True)
class Finding:
    level: Level
    check: str
    message: str

    def line(self) -> str:
        return f"[{self.level.upper():5}] {self.check}: {self.message}"


def _schema_child(props: V1JSONSchemaProps | dict | None, name: str) -> V1JSONSchemaProps | dict | None:
    """The sub-schema of field `name`, stepping into array items. The client deserializes `items`
    (JSONSchemaPropsOrArray) as a plain dict, so both shapes are walked."""
    if props is None:
        return None
    if isinstance(props, dict):
        properties, items = props.get("properties") or {}, props.get("items")
    else:
        properties, items = props.properties or {}, props.items
    if name not in properties and items is not None:
        return _schema_child(items, name)
    return properties.get(name)


def _served_v1(crd: V1CustomResourceDefinition) -> Any:
    return next((v for v in crd.spec.versions if v.name == "v1" and v.served), None)


def check_crds(crds: dict[str, V1CustomResourceDefinition | None]) -> list[Finding]:
    """`crds` maps each name in REQUIRED_CRDS to the CRD read from the cluster (None: not found)."""
    findings = []
    for name in REQUIRED_CRDS:
        crd = crds.get(name)
        if crd is None:
            findings.append(
                Finding(
                    "error",
                    "crds",
                    f"CRD {name} is not installed: install the KubeRay operator: {INSTALL_KUBERAY}",
                )
            )
            continue
        if _served_v1(crd) is None:
            served = [v.name for v in crd.spec.versions if v.served]
            findings.append(
                Finding(
                    "error",
                    "crds",
                    f"CRD {name} serves {served} but not ray.io/v1: KubeRay is older "
                    "than v1.1; upgrade the operator and its CRDs",
                )
            )
            continue
        findings.append(Finding("ok", "crds", f"{name} serves ray.io/v1"))
    rayservice = crds.get("rayservices.ray.io")
    if rayservice is not None and _served_v1(rayservice) is not None:
        findings += _check_crd_features(rayservice)
    return findings


def _check_crd_features(crd: V1CustomResourceDefinition) -> list[Finding]:
    root = _served_v1(crd).schema.open_apiv3_schema
    findings = []
    for path, version, used_for in CRD_FEATURES:
        node = root
        for part in path:
            node = _schema_child(node, part)
        if node is None:
            findings.append(
                Finding(
                    "error",
                    "crds",
                    f"the RayService CRD has no {'.'.join(path)} (KubeRay {version}+, "
                    f"used by the chart's {used_for}): upgrade the operator, then apply the new CRDs "
                    "with `kubectl apply --server-side -f` (helm upgrade does not update CRDs)",
                )
            )
    if not findings:
        findings.append(Finding("ok", "crds", "the RayService CRD has every field the chart uses"))
    return findings


def _gpus(node: V1Node) -> int:
    allocatable = (node.status.allocatable if node.status else None) or {}
    return int(parse_quantity(allocatable.get(GPU_RESOURCE, "0")))


def _ready(node: V1Node) -> bool:
    conditions = (node.status.conditions if node.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def check_gpus(nodes: Iterable[V1Node], gpus_per_pod: int) -> list[Finding]:
    """GPUs the scheduler can use: allocatable nvidia.com/gpu on Ready, schedulable nodes."""
    gpu_nodes = [n for n in nodes if _gpus(n) > 0]
    if not gpu_nodes:
        return [
            Finding(
                "error",
                "gpus",
                f"no node has allocatable {GPU_RESOURCE}: install the NVIDIA "
                "device plugin (or the GPU operator) on the GPU nodes, or deploy with "
                "gpuWorkers.enabled=false",
            )
        ]
    usable = [n for n in gpu_nodes if _ready(n) and not (n.spec and n.spec.unschedulable)]
    findings = []
    unusable = sorted(n.metadata.name for n in gpu_nodes if n not in usable)
    if unusable:
        findings.append(Finding("warn", "gpus", f"GPU nodes not Ready or cordoned: {', '.join(unusable)}"))
    if not usable:
        return [
            *findings,
            Finding(
                "error",
                "gpus",
                "no GPU node is Ready and schedulable: uncordon (kubectl uncordon NODE) or repair them",
            ),
        ]
    total, largest = sum(_gpus(n) for n in usable), max(_gpus(n) for n in usable)
    findings.append(
        Finding("ok", "gpus", f"{total} allocatable GPUs on {len(usable)} nodes (largest {largest})")
    )
    if largest < gpus_per_pod:
        findings.append(
            Finding(
                "error",
                "gpus",
                f"gpuWorkers.gpusPerPod={gpus_per_pod} but the largest node "
                f"has {largest} allocatable GPUs: lower gpusPerPod or add bigger nodes",
            )
        )
    taints = sorted(
        {
            f"{t.key}{'=' + t.value if t.value else ''}:{t.effect}"
            for n in usable
            for t in ((n.spec.taints if n.spec else None) or [])
            if t.effect in ("NoSchedule", "NoExecute")
        }
    )
    if taints:
        findings.append(
            Finding(
                "warn",
                "gpus",
                f"GPU nodes carry taints {', '.join(taints)}: gpuWorkers.tolerations must tolerate them",
            )
        )
    return findings


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in status.get("conditions") or []}


def check_rayservice(rayservice: dict[str, Any] | None, namespace: str, name: str) -> list[Finding]:
    """The RayService's own status: Ready condition, endpoints, upgrade in progress."""
    if rayservice is None:
        return [
            Finding(
                "error",
                "rayservice",
                f"RayService {name} not found in namespace {namespace}: "
                f"helm install {name} helm/msaserve -n {namespace} (or pass --name/--namespace)",
            )
        ]
    status = rayservice.get("status") or {}
    conditions = _conditions(status)
    findings = []
    ready = conditions.get("Ready")
    if ready is not None and ready.get("status") == "True":
        findings.append(Finding("ok", "rayservice", f"{name} is Ready"))
    elif ready is not None:
        findings.append(
            Finding(
                "error",
                "rayservice",
                f"{name} is not Ready ({ready.get('reason')}): "
                f"{ready.get('message') or 'see kubectl describe rayservice ' + name}",
            )
        )
    elif status.get("serviceStatus") != "Running":
        findings.append(
            Finding(
                "warn",
                "rayservice",
                f"{name} status is {status.get('serviceStatus')!r} "
                "(not yet Running): the cluster may still be starting",
            )
        )
    upgrade = conditions.get("UpgradeInProgress")
    if upgrade is not None and upgrade.get("status") == "True":
        pending = (status.get("pendingServiceStatus") or {}).get("rayClusterName", "?")
        findings.append(
            Finding(
                "warn",
                "rayservice",
                f"an upgrade is in progress (pending cluster {pending}): "
                "with upgradeStrategy NewCluster it needs a second full set of GPUs; "
                "see docs/deployment.md#6-upgrade",
            )
        )
    if not status.get("numServeEndpoints"):
        findings.append(
            Finding(
                "error",
                "rayservice",
                "no Serve endpoints: the API Service has no ready "
                "pods yet; check the application status below and the pods",
            )
        )
    return findings


def check_applications(rayservice: dict[str, Any] | None) -> list[Finding]:
    """Serve application and deployment statuses of the active cluster."""
    if rayservice is None:
        return []
    active = (rayservice.get("status") or {}).get("activeServiceStatus") or {}
    apps = active.get("applicationStatuses") or {}
    if APP_NAME not in apps:
        return [
            Finding(
                "error",
                "serve",
                f"no Serve application {APP_NAME!r} yet (apps: {sorted(apps)}): "
                "the operator may not have submitted serveConfigV2; see the head pod's logs "
                "(kubectl logs <head pod> -c ray-head) and the operator's logs",
            )
        ]
    app = apps[APP_NAME]
    findings = []
    state = app.get("status", "UNKNOWN")
    if state == "RUNNING":
        findings.append(Finding("ok", "serve", f"application {APP_NAME} is RUNNING"))
    else:
        level: Level = "warn" if state in ("DEPLOYING", "NOT_STARTED") else "error"
        findings.append(
            Finding(
                level, "serve", f"application {APP_NAME} is {state}: {app.get('message') or 'no message'}"
            )
        )
    for deployment, d in sorted((app.get("serveDeploymentStatuses") or {}).items()):
        if d.get("status") not in ("HEALTHY", None):
            findings.append(
                Finding(
                    "error" if d.get("status") == "UNHEALTHY" else "warn",
                    "serve",
                    f"deployment {deployment} is {d.get('status')}: {d.get('message') or 'no message'}",
                )
            )
    return findings


def check_pods(pods: Iterable[V1Pod]) -> list[Finding]:
    """Pods that cannot be scheduled or whose containers cannot start, with the kubelet's reason."""
    findings = []
    for pod in pods:
        name = pod.metadata.name
        for c in (pod.status.conditions if pod.status else None) or []:
            if c.type == "PodScheduled" and c.status == "False":
                hint = (
                    " (add GPU nodes, lower gpuWorkers.gpusPerPod, or check tolerations/nodeSelector)"
                    if GPU_RESOURCE in (c.message or "")
                    else ""
                )
                findings.append(Finding("error", "pods", f"{name} cannot be scheduled: {c.message}{hint}"))
        statuses = (
            (pod.status.init_container_statuses or []) + (pod.status.container_statuses or [])
            if pod.status
            else []
        )
        for s in statuses:
            waiting = s.state.waiting if s.state else None
            if waiting is not None and waiting.reason in (
                "ImagePullBackOff",
                "ErrImagePull",
                "CrashLoopBackOff",
                "CreateContainerConfigError",
            ):
                findings.append(
                    Finding(
                        "error",
                        "pods",
                        f"{name}/{s.name}: {waiting.reason}: "
                        f"{waiting.message or 'kubectl describe pod ' + name}",
                    )
                )
    return findings


def cluster_names(rayservice: dict[str, Any] | None) -> list[str]:
    """The active and pending RayCluster names of a RayService (their pods carry ray.io/cluster)."""
    status = (rayservice or {}).get("status") or {}
    names = [
        (status.get(key) or {}).get("rayClusterName")
        for key in ("activeServiceStatus", "pendingServiceStatus")
    ]
    return [n for n in names if n]
