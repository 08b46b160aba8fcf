"""Day two: closed networks, pods the kubelet keeps, Secrets that GitOps leaves alone, Services that see
one cluster, and an image that exists.

Each test reads the rendered objects as an operator would: which pods a NetworkPolicy admits traffic
to, which QoS class the kubelet gives a pod, whether two offline renders (what Argo CD and Flux do)
produce the same Secret, which pods a Service selects while two clusters of the release run.
"""

import re
from decimal import Decimal
from typing import Any

import helm_python
import pytest
from helm_chart import load_values, with_site

PROFILES = ["default", "gpu", "all-features", "m3"]
RELEASE_PEER = {"app.kubernetes.io/name": "msaserve", "app.kubernetes.io/instance": "demo"}
_SUFFIXES = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "m": Decimal("0.001"),
    "k": 10**3,
    "G": 10**9,
}


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def _groups(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cluster = _one(docs, "RayService")["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def _quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("8", "500m", "64Gi") as a number."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    assert match, value
    number, suffix = match.groups()
    return Decimal(number) * Decimal(_SUFFIXES[suffix] if suffix else 1)


def _qos_class(containers: list[dict[str, Any]]) -> str:
    """The pod QoS class as the kubelet computes it from its containers' cpu and memory."""
    guaranteed, any_set = True, False
    for container in containers:
        requests = container.get("resources", {}).get("requests", {})
        limits = container.get("resources", {}).get("limits", {})
        for resource in ("cpu", "memory"):
            request = requests.get(resource, limits.get(resource))  # a limit alone sets the request
            any_set = any_set or request is not None or resource in limits
            if resource not in limits or _quantity(request) != _quantity(limits[resource]):
                guaranteed = False
    return "Guaranteed" if guaranteed else ("Burstable" if any_set else "BestEffort")


def _pod_containers(docs: list[dict[str, Any]], group_name: str) -> list[dict[str, Any]]:
    spec = _groups(docs)[group_name]["template"]["spec"]
    containers = spec.get("initContainers", []) + spec["containers"]
    cluster = _one(docs, "RayService")["spec"]["rayClusterConfig"]
    if group_name == "head" and cluster.get("enableInTreeAutoscaling"):  # KubeRay adds the autoscaler
        containers.append({"resources": cluster["autoscalerOptions"]["resources"]})
    return containers


# --- 4. every pod behind a NetworkPolicy, with only the flows the design needs -------------------


def _selected(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    return policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("values_name", PROFILES)
def test_every_ray_pod_is_behind_a_network_policy(rendered, values_name: str) -> None:
    docs = rendered[values_name]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for name, group in _groups(docs).items():
        labels = group["template"]["metadata"]["labels"]
        assert [p for p in policies if _selected(p, labels) and "Ingress" in p["spec"]["policyTypes"]], name


def _open_ports(rule: dict[str, Any]) -> set[int]:
    return {p["port"] for p in rule.get("ports", [])}


@pytest.mark.parametrize("values_name", PROFILES)
def test_outside_the_release_only_api_dashboard_and_scrape_get_in(rendered, values_name: str) -> None:
    docs = rendered[values_name]
    values = load_values(values_name)
    serve_port = values.get("serve", {}).get("http", {}).get("port", 8000)
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        component = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        allowed = {"head": {8265, 8080}, "kvcache": {8080}}.get(component, {serve_port, 8080})
        for rule in policy["spec"]["ingress"]:
            peers = rule.get("from", [])
            if peers == [{"podSelector": {"matchLabels": RELEASE_PEER}}]:
                continue  # Ray's own traffic inside the release: every port
            assert rule.get("ports"), (component, rule)  # no rule opens every port to outsiders
            assert _open_ports(rule) <= allowed, (component, rule)
            if not peers:  # open to anyone: only the API port, only where Serve proxies serve it
                assert _open_ports(rule) == {serve_port} and component in ("cpu-worker", "gpu-worker")
    kv = [p for p in docs if p["kind"] == "NetworkPolicy" and p["metadata"]["name"].endswith("-kvcache")]
    assert kv, "the KV cache group has its own policy"


def test_scrape_comes_from_the_prometheus_namespace_by_default(rendered) -> None:
    for policy in (d for d in rendered["default"] if d["kind"] == "NetworkPolicy"):
        [scrape] = [r for r in policy["spec"]["ingress"] if _open_ports(r) == {8080}]
        assert scrape["from"] == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ]


# --- 5. Ray keeps CPU work off GPU and KV cache pods; the kubelet evicts those last ------------------


@pytest.mark.parametrize("values_name", PROFILES)
def test_gpu_and_kvcache_groups_set_num_cpus_and_are_guaranteed(rendered, values_name: str) -> None:
    docs = rendered[values_name]
    groups = _groups(docs)
    for name in ("gpu", "kvcache"):
        assert "num-cpus" in groups[name]["rayStartParams"], name
    for name in ("head", "gpu", "kvcache"):
        assert _qos_class(_pod_containers(docs, name)) == "Guaranteed", name
    assert groups["kvcache"]["rayStartParams"]["num-cpus"] == "0"


def test_qos_rules_as_the_kubelet_applies_them() -> None:
    exact = {
        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"cpu": "8", "memory": "65536Mi"}}
    }
    burst = {
        "resources": {"requests": {"cpu": "4", "memory": "64Gi"}, "limits": {"cpu": "8", "memory": "64Gi"}}
    }
    assert _qos_class([exact]) == "Guaranteed"
    assert _qos_class([exact, burst]) == "Burstable"
    assert _qos_class([{"resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}]) == "Guaranteed"
    assert _qos_class([{}]) == "BestEffort"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gpuWorkers": {"resources": {"limits": {"cpu": "16"}}}}, "GPU pods must be Guaranteed"),
        ({"gpuWorkers": {"rayStartParams": {"num-cpus": "2"}}}, "ask for 4 CPUs"),
        ({"gpuWorkers": {"rayStartParams": {"num-cpus": None}}}, "gpuWorkers.rayStartParams has no num-cpus"),
        ({"kvcache": {"rayStartParams": {"num-cpus": None}}}, "kvcache.rayStartParams has no num-cpus"),
        (
            {
                "model": {
                    "source": "download",
                    "download": {"repoId": "o/m", "resources": {"limits": {"memory": "8Gi"}}},
                },
                "serve": {"model": {"spec": "/models/model"}},
            },
            "model.download.resources: requests.memory=4Gi differs",
        ),
    ],
)
def test_gpu_pods_that_would_be_burstable_or_crowded_are_refused(
    chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(values=with_site(values), name="demo", namespace="ml", is_install=True)
    assert message in str(refused.value)


# --- 6. Secrets: the same bytes on every render; API keys only where the gateway runs ------------


@pytest.mark.parametrize("values_name", [*PROFILES, "minimal"])
def test_two_offline_renders_give_the_same_secrets(chart, values_name: str) -> None:
    """Argo CD and Flux render without a cluster on every sync and apply whatever differs."""
    from helm_chart import render_docs

    values = load_values(values_name)
    first, second = ([d for d in render_docs(chart, values) if d["kind"] == "Secret"] for _ in range(2))
    assert first == second


def test_literal_keys_make_a_stable_secret(render) -> None:
    values = {"apiKeys": {"existingSecret": "", "keys": ["sk-abcdefghijklmnop"]}}
    first, second = ([d for d in render(values) if d["kind"] == "Secret"] for _ in range(2))
    assert first == second and len(first) == 1


def test_no_secret_source_is_refused_not_randomised(chart) -> None:
    """Without existingSecret, keys or generate the chart refuses instead of drawing random keys."""
    values = {"image": {"repository": "registry.example.com/ml/msaserve", "tag": "0.1.0"}}
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(values=values, name="demo", namespace="ml", is_install=True)
    assert "set apiKeys.existingSecret" in str(refused.value)
    values["apiKeys"] = {"existingSecret": "keys"}
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(values=values, name="demo", namespace="ml", is_install=True)
    assert "set rayAuth.existingSecret" in str(refused.value)


@pytest.mark.parametrize("values_name", PROFILES)
def test_api_keys_reach_only_the_gateway_group(rendered, values_name: str) -> None:
    for name, group in _groups(rendered[values_name]).items():
        spec = group["template"]["spec"]
        env_names = {e["name"] for c in spec.get("initContainers", []) + spec["containers"] for e in c["env"]}
        assert ("MSASERVE_API_KEYS" in env_names) == (name == "cpu"), name


def test_a_gateway_that_could_start_without_the_keys_is_refused(chart) -> None:
    unpinned = {"serve": {"deployments": {"gateway": {"ray_actor_options": {"resources": None}}}}}
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(values=with_site(unpinned), name="demo", namespace="ml", is_install=True)
    assert "the gateway could start on a pod without MSASERVE_API_KEYS" in str(refused.value)


# --- 7. Services see one cluster; the image is one the user has ---------------------------------


@pytest.mark.parametrize("values_name", [*PROFILES, "minimal"])
def test_no_chart_service_routes_traffic_to_both_clusters(rendered, values_name: str) -> None:
    """During an upgrade both clusters' pods carry the chart's labels; only KubeRay's Services (API,
    <name>-head-svc) follow the active one. A chart Service over Ray pods may only be headless (scrape)."""
    for service in (d for d in rendered[values_name] if d["kind"] == "Service"):
        if "app.kubernetes.io/instance" in service["spec"].get("selector", {}):
            assert service["spec"].get("clusterIP") == "None", service["metadata"]["name"]
            assert {p["name"] for p in service["spec"]["ports"]} == {"metrics"}


def test_the_image_must_be_named(chart) -> None:
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(values={}, name="demo", namespace="ml", is_install=True)
    message = str(refused.value)
    assert "msaserve publishes no image" in message and "docker build" in message
    assert "set image.repository and image.tag" in message


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ({"tag": "1.2.3"}, "registry.example.com/ml/msaserve:1.2.3"),
        ({"digest": "sha256:" + "a" * 64}, "registry.example.com/ml/msaserve@sha256:" + "a" * 64),
    ],
)
def test_image_by_tag_or_digest_everywhere(render, image: dict[str, str], expected: str) -> None:
    docs = render({"image": image})
    for name, group in _groups(docs).items():
        assert group["template"]["spec"]["containers"][0]["image"] == expected, name


def test_closed_egress_admits_the_release_dns_and_listed_destinations(rendered) -> None:
    """m3 closes egress: the release, DNS and its Redis; the default leaves egress open."""
    redis = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "redis"}}}
    policies = [d for d in rendered["m3"] if d["kind"] == "NetworkPolicy"]
    assert len(policies) == 4
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        destinations = [(rule["to"], _open_ports(rule)) for rule in spec["egress"]]
        assert destinations[0] == ([{"podSelector": {"matchLabels": RELEASE_PEER}}], set())
        assert destinations[1][1] == {53}
        assert destinations[2] == ([redis], {6379})
        assert destinations[3] == ([{"ipBlock": {"cidr": "192.0.2.10/32"}}], {6443})  # API server
        assert len(destinations) == 4
    for policy in (d for d in rendered["default"] if d["kind"] == "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]


def test_closed_egress_without_destinations_is_refused(chart) -> None:
    closed = {"networkPolicy": {"egress": {"enabled": True}}}
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(values=with_site(closed), name="demo", namespace="ml", is_install=True)
    assert "list them in networkPolicy.egress.to" in str(refused.value)
