"""The chart renders, lints strictly and every object it renders is valid.

Core kinds: kubernetes-validate (strict) for Kubernetes 1.30 and 1.33, including the pod templates
and the API Service embedded in the RayService. RayService (and its rayClusterConfig as a
RayCluster), ServiceMonitor and PodMonitor: the vendored CRD schemas in tests/helm/schemas, made
strict. Every rendered object is checked by one of the two; none is left unvalidated.
"""

import json
import re
from typing import Any

import helm_python
import kubernetes_validate
import pytest
from helm_chart import CHART, KUBE_VERSIONS, VALUES_FILES, load_values

CRD_KINDS = {"RayService"}  # its embedded pods and Service also go through kubernetes-validate
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor"}  # monitoring.coreos.com: the vendored CRDs


def _pod_templates(rayservice: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]
    return [(name, g["template"]) for name, g in groups]


def _embedded_core_objects(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    """Pods from each group's template and the serveService, as standalone objects."""
    objects = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"x-{name}", **t["metadata"]},
            "spec": t["spec"],
        }
        for name, t in _pod_templates(rayservice)
    ]
    service = rayservice["spec"]["serveService"]
    objects.append({"apiVersion": "v1", "kind": "Service", **service})
    return objects


def test_kubernetes_validate_supports_the_versions_under_test() -> None:
    supported = kubernetes_validate.utils.all_versions()
    assert {v.rsplit(".", 1)[0] for v in KUBE_VERSIONS} <= {v.rsplit(".", 1)[0] for v in supported}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_name", list(VALUES_FILES))
def test_strict_lint_is_clean(values_name: str, kube_version: str) -> None:
    report = helm_python.lint(
        str(CHART), load_values(values_name), strict=True, kube_version=f"v{kube_version}"
    )
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_name", list(VALUES_FILES))
def test_core_objects_validate_strictly(rendered, values_name: str, kube_version: str) -> None:
    docs = rendered[values_name]
    checked = []
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            for embedded in _embedded_core_objects(doc):
                kubernetes_validate.validate(embedded, kube_version, strict=True)
                checked.append(embedded["kind"])
        elif doc["kind"] not in MONITORING_KINDS:
            kubernetes_validate.validate(doc, kube_version, strict=True)
            checked.append(doc["kind"])
    assert {"Pod", "Service"} <= set(checked)


@pytest.mark.parametrize("values_name", list(VALUES_FILES))
def test_rayservice_and_raycluster_match_the_kuberay_crds(rendered, crd_validators, values_name: str) -> None:
    [rayservice] = [d for d in rendered[values_name] if d["kind"] == "RayService"]
    errors = [
        f"{'.'.join(map(str, e.path))}: {e.message}"
        for e in crd_validators["RayService"].iter_errors(rayservice)
    ]
    assert errors == []
    raycluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "demo"},
        "spec": rayservice["spec"]["rayClusterConfig"],
    }
    errors = [
        f"{'.'.join(map(str, e.path))}: {e.message}"
        for e in crd_validators["RayCluster"].iter_errors(raycluster)
    ]
    assert errors == []


@pytest.mark.parametrize("values_name", ["all-features", "m3"])
def test_monitors_match_the_prometheus_operator_crds(rendered, crd_validators, values_name: str) -> None:
    monitors = [d for d in rendered[values_name] if d["kind"] in MONITORING_KINDS]
    assert monitors
    for monitor in monitors:
        errors = [
            f"{monitor['kind']} {'.'.join(map(str, e.path))}: {e.message}"
            for e in crd_validators[monitor["kind"]].iter_errors(monitor)
        ]
        assert errors == []


def test_monitor_validation_can_fail(rendered, crd_validators) -> None:
    [monitor] = [d for d in rendered["all-features"] if d["kind"] == "PodMonitor"]
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    for bad_endpoint in ({**endpoint, "prot": "x"}, {**endpoint, "interval": "soon"}):
        bad = {**monitor, "spec": {**monitor["spec"], "podMetricsEndpoints": [bad_endpoint]}}
        assert list(crd_validators["PodMonitor"].iter_errors(bad)), bad_endpoint


def test_crd_validation_is_strict_and_can_fail(rendered, crd_validators) -> None:
    """A misspelt field, a wrong type and a bad enum are each caught (the check is not vacuous)."""
    [rayservice] = [d for d in rendered["default"] if d["kind"] == "RayService"]
    group = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    for field, value in (("minReplica", 1), ("maxReplicas", "four"), ("replicas", 2**40)):
        bad_group = {**group, field: value}
        bad = {
            **rayservice,
            "spec": {
                **rayservice["spec"],
                "rayClusterConfig": {
                    **rayservice["spec"]["rayClusterConfig"],
                    "workerGroupSpecs": [bad_group],
                },
            },
        }
        assert list(crd_validators["RayService"].iter_errors(bad)), field
    bad_auth = {
        **rayservice,
        "spec": {
            **rayservice["spec"],
            "rayClusterConfig": {
                **rayservice["spec"]["rayClusterConfig"],
                "authOptions": {"mode": "password"},
            },
        },
    }
    assert list(crd_validators["RayService"].iter_errors(bad_auth))


def test_kubernetes_validate_can_fail() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "i", "securityContext": {"readOnlyRootFS": True}}]},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, "1.33.0", strict=True)


def test_service_monitor_selects_the_metrics_service(rendered) -> None:
    docs = rendered["all-features"]
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    [metrics] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= metrics["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["ml"]
    port_names = {p["name"] for p in metrics["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    assert metrics["spec"]["clusterIP"] == "None"
    # The metrics Service selects every Ray pod of the release.
    [rayservice] = [d for d in docs if d["kind"] == "RayService"]
    for name, template in _pod_templates(rayservice):
        assert metrics["spec"]["selector"].items() <= template["metadata"]["labels"].items(), name
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == metrics["spec"]["ports"][0]["port"], name
    # ...and Ray exports on that port in every group.
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert group["rayStartParams"]["metrics-export-port"] == str(metrics["spec"]["ports"][0]["port"])


def test_grafana_dashboard_plots_real_metric_names(rendered) -> None:
    """Every series the dashboard queries is one msaserve exports (Ray prefixes `ray_`)."""
    from msaserve.platform.metrics import METRIC_NAMES

    [config_map] = [
        d for d in rendered["all-features"] if d["kind"] == "ConfigMap" and "msaserve.json" in d["data"]
    ]
    dashboard = json.loads(config_map["data"]["msaserve.json"])
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m.removesuffix("_bucket") for e in exprs for m in re.findall(r"ray_(msaserve_[a-z0-9_]+)", e)}
    assert used <= set(METRIC_NAMES), used - set(METRIC_NAMES)
    required = {
        "ttft_seconds",
        "tpot_seconds",
        "e2e_latency_seconds",
        "output_tokens",
        "pages_used",
        "prefix_hit_rate",
        "index_load_latency_seconds",
        "page_fetch_latency_seconds",
        "router_decisions",
        "preprocess_latency_seconds",
    }
    assert {f"msaserve_{name}" for name in required} <= used
