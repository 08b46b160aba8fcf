"""Day two: upgrades that do not replace the GPU cluster for nothing, drains that let sessions finish,
and a head whose restart or eviction does not take the replicas with it.

KubeRay replaces the whole Ray cluster (blue/green: twice the GPUs) whenever rayClusterConfig changes,
so a chart bump must leave it byte for byte as it was, and a change of `serve:` must touch only
serveConfigV2 (applied in place by Serve). Pods that stop (node drain, scale-down, the old cluster of
an upgrade) must drain for as long as a request may run: serve.http.request_timeout_s.
"""

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from helm_chart import CHART, load_values, render_docs, with_site

PROFILES = ["default", "gpu", "all-features", "m3"]
DRAIN_MARGIN_S = 60  # what the chart leaves `ray stop` after the preStop drain


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def _groups(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def _request_timeout_s(rayservice: dict[str, Any]) -> float:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])["http_options"]["request_timeout_s"]


def _chart_copy(tmp_path: Path, **chart_fields: str) -> Path:
    """A copy of the chart under test with Chart.yaml fields replaced (a chart bump)."""
    copy = tmp_path / "msaserve"
    shutil.copytree(CHART, copy)
    meta = yaml.safe_load((copy / "Chart.yaml").read_text())
    (copy / "Chart.yaml").write_text(yaml.safe_dump({**meta, **chart_fields}, sort_keys=False))
    return copy


def _render_chart(path: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm_python.Chart.load(str(path)) as chart:
        return render_docs(chart, values)


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)


# --- 1. a chart bump is not a cluster change -----------------------------------------------------


BUMPS = [{"appVersion": "0.2.0"}, {"version": "0.2.0", "appVersion": "0.2.0"}]


@pytest.mark.parametrize("bump", BUMPS, ids=["appVersion", "version+appVersion"])
@pytest.mark.parametrize("values_name", ["default", "all-features", "m3"])
def test_chart_bump_leaves_the_ray_cluster_spec_byte_identical(
    tmp_path: Path, values_name: str, bump: dict[str, str]
) -> None:
    """`helm upgrade` v1 → v2 with only the chart's versions changed: KubeRay must see no cluster change."""
    values = load_values(values_name)
    v1 = _one(_render_chart(CHART, values), "RayService")
    v2 = _one(_render_chart(_chart_copy(tmp_path, **bump), values), "RayService")
    assert v1["metadata"]["labels"] != v2["metadata"]["labels"]  # the bump is visible where it is harmless
    assert _canonical(v1["spec"]["rayClusterConfig"]) == _canonical(v2["spec"]["rayClusterConfig"])
    assert _only_service_labels_differ(v1, v2)


def _only_service_labels_differ(v1: dict[str, Any], v2: dict[str, Any]) -> bool:
    """The serveService's labels carry the chart version; KubeRay updates that Service in place."""
    strip = [
        {**rs["spec"], "serveService": {**rs["spec"]["serveService"], "metadata": {}}} for rs in (v1, v2)
    ]
    return _canonical(strip[0]) == _canonical(strip[1])


def test_pod_templates_carry_no_chart_or_app_version(rendered) -> None:
    for values_name in PROFILES:
        for name, group in _groups(_one(rendered[values_name], "RayService")).items():
            labels = group["template"]["metadata"]["labels"]
            assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels, name


def test_serve_config_change_touches_only_serve_config_v2(render) -> None:
    before = _one(render({}), "RayService")
    serve_change = {
        "router": {"policy": "prefix_affinity"},
        "deployments": {"model": {"max_ongoing_requests": 8}},
    }
    after = _one(render({"serve": serve_change}), "RayService")
    changed = {
        key for key in before["spec"] if _canonical(before["spec"][key]) != _canonical(after["spec"][key])
    }
    assert changed == {"serveConfigV2"}


def test_a_real_cluster_change_is_seen(render) -> None:
    """The byte-identity above is not vacuous: a new image does change rayClusterConfig."""
    before = _one(render({}), "RayService")["spec"]["rayClusterConfig"]
    after = _one(render({"image": {"tag": "0.2.0"}}), "RayService")["spec"]["rayClusterConfig"]
    assert _canonical(before) != _canonical(after)


# --- 2. drains that let running requests finish ---------------------------------------------------


@pytest.mark.parametrize("values_name", PROFILES)
def test_workers_drain_for_as_long_as_a_request_may_run(rendered, values_name: str) -> None:
    rayservice = _one(rendered[values_name], "RayService")
    timeout = _request_timeout_s(rayservice)
    drain = {d["metadata"]["name"]: d for d in rendered[values_name] if d["kind"] == "ConfigMap"}
    [drain_map] = [d for name, d in drain.items() if name.endswith("-drain")]
    assert drain_map["data"]["drain.py"] == (CHART / "files" / "drain.py").read_text().rstrip("\n")
    for name, group in _groups(rayservice).items():
        if name == "head":
            continue
        spec = group["template"]["spec"]
        grace = spec["terminationGracePeriodSeconds"]
        pre_stop = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[:2] == ["python", "/etc/msaserve/drain/drain.py"], name
        assert pre_stop[-1] == str(grace - DRAIN_MARGIN_S), name
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["drain"]["configMap"]["name"] == drain_map["metadata"]["name"], name
        if name in ("cpu", "gpu"):  # the gateway and the model hold requests for their whole life
            assert grace - DRAIN_MARGIN_S >= timeout, name
    assert rayservice["spec"]["rayClusterDeletionDelaySeconds"] >= timeout
    deployments = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["deployments"]
    assert {d["name"]: d["graceful_shutdown_timeout_s"] for d in deployments} == {
        "Gateway": timeout,
        "Model": timeout,
    }


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"gpuWorkers": {"terminationGracePeriodSeconds": 300}},
            "gpuWorkers.terminationGracePeriodSeconds=300",
        ),
        ({"serve": {"http": {"request_timeout_s": 3600}}}, "set it to at least 3660"),
        ({"upgradeStrategy": {"oldClusterDeletionDelaySeconds": 60}}, "delete the old cluster while"),
    ],
)
def test_drains_shorter_than_a_request_are_refused(chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(values=with_site(values), name="demo", namespace="ml", is_install=True)
    assert message in str(refused.value)


def _drain_module():
    spec = importlib.util.spec_from_file_location("msaserve_chart_drain", CHART / "files" / "drain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_drain_hook_waits_until_the_replicas_have_moved() -> None:
    drain = _drain_module()
    now = [0.0]
    left = iter([3, 2, 1, 0])
    assert (
        drain.wait_until_gone(
            lambda: next(left),
            deadline=600.0,
            clock=lambda: now[0],
            sleep=lambda s: now.__setitem__(0, now[0] + s),
        )
        == 0
    )
    assert now[0] == 3 * drain.POLL_SECONDS


def test_drain_hook_stops_waiting_when_the_head_is_gone() -> None:
    """The whole cluster is deleted (or the head died without GCS FT): nothing will move the replicas."""
    drain = _drain_module()
    now = [0.0]
    answers = iter([2, None, 1])  # t=0 s: 2, t=5 s: unreachable, t=10 s: 1, from t=15 s: unreachable
    left = drain.wait_until_gone(
        lambda: next(answers, None),
        deadline=600.0,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    assert left is None
    # The answer at t=10 s restarted the clock: it gives up HEAD_GONE_SECONDS after t=15 s.
    assert now[0] == 15.0 + drain.HEAD_GONE_SECONDS


def test_drain_hook_gives_up_at_its_budget() -> None:
    drain = _drain_module()
    now = [0.0]
    left = drain.wait_until_gone(
        lambda: 2, deadline=12.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    )
    assert left == 2 and now[0] == 12.0


# --- 3. a head restart keeps the replicas; the head does not block node drains -------------------


def test_gcs_fault_tolerance_with_external_redis(rendered) -> None:
    for values_name in ("all-features", "m3"):
        cluster = _one(rendered[values_name], "RayService")["spec"]["rayClusterConfig"]
        options = cluster["gcsFaultToleranceOptions"]
        assert options["redisAddress"] == "redis-ha.redis.svc.cluster.local:6379"
        assert set(options["redisPassword"]["valueFrom"]["secretKeyRef"]) == {"name", "key"}
        # Each cluster of an upgrade must keep its own GCS tables: KubeRay names them by cluster UID.
        assert "externalStorageNamespace" not in options
    assert (
        "gcsFaultToleranceOptions" not in _one(rendered["default"], "RayService")["spec"]["rayClusterConfig"]
    )


@pytest.mark.parametrize("values_name", PROFILES)
def test_head_pdb_lets_a_node_drain_evict_it(rendered, values_name: str) -> None:
    [head_pdb] = [
        d
        for d in rendered[values_name]
        if d["kind"] == "PodDisruptionBudget"
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == "head"
    ]
    assert head_pdb["spec"]["maxUnavailable"] not in (0, "0", "0%")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"podDisruptionBudget": {"head": {"maxUnavailable": 0}}},
            "every `kubectl drain` of its node would hang",
        ),
        ({"gcsFaultTolerance": {"enabled": True}}, "set gcsFaultTolerance.redisAddress"),
    ],
)
def test_head_settings_that_break_drains_or_recovery_are_refused(
    chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(values=with_site(values), name="demo", namespace="ml", is_install=True)
    assert message in str(refused.value)
