"""The Grafana dashboard the chart ships: valid for Grafana, and every panel plots a series msaserve exports.

Schema: Grafana's dashboard JSON schema (v1 dashboard kind), the Prometheus query schema for each
target and the time-series panel's options schema, all from grafana-foundation-sdk (vendored in
schemas/, see its README). Metrics: each series a query names is one of msaserve/platform/metrics.py,
used as its kind allows (histogram_quantile on a histogram's _bucket, rate on a counter, a gauge
bare), and grouped only by labels the series carries.
"""

import json
import re
from typing import Any

import jsonschema
import pytest
from helm_chart import CHART, SCHEMAS

from msaserve.platform.metrics import METRICS, PREFIX

DASHBOARD = CHART / "files" / "grafana-dashboard.json"
# Labels every scraped series has besides its tag keys: Prometheus adds namespace/pod (the monitors'
# relabelings), histograms have le.
SCRAPE_LABELS = {"namespace", "pod", "instance", "job", "ray_node_type", "le"}


def _schema(name: str, definition: str | None = None) -> dict[str, Any]:
    schema = json.loads((SCHEMAS / name).read_text())
    if definition is not None:
        schema = {"$ref": f"#/definitions/{definition}", "definitions": schema["definitions"]}
    return schema


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _errors(schema: dict[str, Any], instance: Any) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(instance)]


def test_dashboard_matches_grafanas_schema(dashboard) -> None:
    assert _errors(_schema("grafana_dashboard.jsonschema.json"), dashboard) == []
    query_schema = _schema("grafana_prometheus.jsonschema.json")
    options_schema = _schema("grafana_timeseries.jsonschema.json", "Options")
    for panel in dashboard["panels"]:
        assert panel["type"] == "timeseries", panel["title"]
        assert _errors(options_schema, panel["options"]) == [], panel["title"]
        for target in panel["targets"]:
            assert _errors(query_schema, target) == [], (panel["title"], target["refId"])


def test_dashboard_schema_can_fail(dashboard) -> None:
    bad = {**dashboard, "panels": [{**dashboard["panels"][0], "gridPos": {"h": "tall"}}]}
    assert _errors(_schema("grafana_dashboard.jsonschema.json"), bad)
    assert _errors(_schema("grafana_dashboard.jsonschema.json"), {**dashboard, "refresh": 30})


def _series(expr: str) -> list[tuple[str, str]]:
    """(metric, suffix) of every msaserve series the query names, in `name` or `__name__=~` form."""
    names = re.findall(r"ray_(msaserve_[a-z0-9_]+?)(_bucket|_total|\(_total\)\?)?(?![a-z0-9_])", expr)
    return [(name, suffix.replace("(_total)?", "_total")) for name, suffix in names]


def _grouping(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(",")}


def test_every_panel_plots_an_exported_series_as_its_kind_allows(dashboard) -> None:
    seen = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            series = _series(expr)
            assert series, (panel["title"], expr)
            for full_name, suffix in series:
                name = full_name.removeprefix(PREFIX)
                assert name in METRICS, (panel["title"], full_name)
                kind, _, tags = METRICS[name]
                if kind.startswith("histogram"):
                    assert suffix == "_bucket" and "histogram_quantile" in expr, (panel["title"], expr)
                elif kind == "counter":
                    assert suffix == "_total" and "rate(" in expr, (panel["title"], expr)
                else:
                    assert suffix == "" and "rate(" not in expr, (panel["title"], expr)
                assert _grouping(expr) <= set(tags) | SCRAPE_LABELS, (panel["title"], expr)
                seen.add(name)
    # The panels an operator needs on day two: latency, throughput, KV pages, routing, media.
    assert {"ttft_seconds", "tpot_seconds", "requests", "pages_used", "page_fetch_latency_seconds"} <= seen


def test_series_parsing_sees_every_form() -> None:
    assert _series('rate({__name__=~"ray_msaserve_requests(_total)?"}[1m])') == [
        ("msaserve_requests", "_total")
    ]
    assert _series("rate(ray_msaserve_ttft_seconds_bucket[1m])") == [("msaserve_ttft_seconds", "_bucket")]
    assert _series("sum(ray_msaserve_pages_used)") == [("msaserve_pages_used", "")]
    assert _grouping("sum by (le, model) (x)") == {"le", "model"}
