"""`msaserve cluster check`: KubeRay CRDs, allocatable GPUs, the RayService and its Serve app.

Reads the cluster through the kubeconfig (or the in-cluster service account); the checks themselves
are pure functions in msaserve.platform.cluster_check. Exit status 1 when any check fails.
"""

import argparse
import sys
from typing import Any

from msaserve.platform.cluster_check import (
    REQUIRED_CRDS,
    Finding,
    check_applications,
    check_crds,
    check_gpus,
    check_pods,
    check_rayservice,
    cluster_names,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("cluster", help="Inspect the Kubernetes cluster msaserve runs on.")
    commands = parser.add_subparsers(dest="cluster_command", required=True)
    check = commands.add_parser(
        "check",
        help="Check KubeRay, GPUs, the RayService and the Serve application, with what to fix.",
        description=__doc__,
    )
    check.add_argument("-n", "--namespace", default="default", help="Namespace of the release.")
    check.add_argument(
        "--name", default="msaserve", help="RayService name (the chart's full name, see NOTES)."
    )
    check.add_argument(
        "--gpus-per-pod", type=int, default=1, help="gpuWorkers.gpusPerPod of the release (0: CPU only)."
    )
    check.add_argument("--context", help="kubeconfig context (default: the current one).")
    check.set_defaults(func=run_check)


def _client(context: str | None) -> Any:
    from kubernetes import client, config

    try:
        config.load_kube_config(context=context)
    except config.ConfigException:
        config.load_incluster_config()
    return client


def gather(client: Any, namespace: str, name: str, gpus_per_pod: int) -> list[Finding]:
    """Read the objects the checks need; API errors become findings, never tracebacks."""
    from kubernetes.client.exceptions import ApiException

    findings: list[Finding] = []
    crds = {}
    for crd_name in REQUIRED_CRDS:
        try:
            crds[crd_name] = client.ApiextensionsV1Api().read_custom_resource_definition(crd_name)
        except ApiException as e:
            if e.status != 404:
                return [Finding("error", "crds", f"cannot read CRD {crd_name}: HTTP {e.status} {e.reason}")]
            crds[crd_name] = None
    findings += check_crds(crds)
    if gpus_per_pod > 0:
        try:
            findings += check_gpus(client.CoreV1Api().list_node().items, gpus_per_pod)
        except ApiException as e:
            findings.append(
                Finding(
                    "warn",
                    "gpus",
                    f"cannot list nodes (HTTP {e.status}): GPUs not checked; "
                    "a ClusterRole with nodes/list is needed",
                )
            )
    rayservice = None
    if crds.get("rayservices.ray.io") is not None:
        try:
            rayservice = client.CustomObjectsApi().get_namespaced_custom_object(
                "ray.io", "v1", namespace, "rayservices", name
            )
        except ApiException as e:
            if e.status != 404:
                findings.append(Finding("error", "rayservice", f"cannot read RayService: HTTP {e.status}"))
    findings += check_rayservice(rayservice, namespace, name)
    findings += check_applications(rayservice)
    clusters = cluster_names(rayservice)
    if clusters:
        selector = f"ray.io/cluster in ({','.join(clusters)})"
        pods = client.CoreV1Api().list_namespaced_pod(namespace, label_selector=selector).items
        findings += check_pods(pods)
    return findings


def run_check(args: argparse.Namespace) -> int:
    try:
        client = _client(args.context)
    except Exception as e:  # no kubeconfig and not in a pod: say so instead of a traceback
        print(f"cluster check: cannot load a kubeconfig or in-cluster config: {e}", file=sys.stderr)
        return 2
    findings = gather(client, args.namespace, args.name, args.gpus_per_pod)
    for finding in findings:
        print(finding.line())
    return 1 if any(f.level == "error" for f in findings) else 0
