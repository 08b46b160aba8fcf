"""The chart under test: paths, values files, rendering, and CRD schemas made checkable.

Shared by tests/helm (imported by name: tests/ has no packages, hence the unique module name).
"""

import os
from pathlib import Path
from typing import Any

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[2]
# MSASERVE_CHART points the tests at another copy of the chart and MSASERVE_CI_VALUES at its values
# files, e.g. the chart before a fix (`git archive REV helm/msaserve | tar -x -C /tmp/old`), to see a
# test fail on it; a profile that copy lacks then renders with that chart's own defaults.
CHART = Path(os.environ.get("MSASERVE_CHART", REPO / "helm" / "msaserve"))
CI_VALUES = Path(os.environ.get("MSASERVE_CI_VALUES", REPO / "helm" / "msaserve" / "ci"))
SCHEMAS = Path(__file__).resolve().parent / "schemas"  # vendored CRDs and JSON schemas, see schemas/README.md
VALUES_FILES = {
    "default": CI_VALUES / "default-values.yaml",
    "gpu": CI_VALUES / "gpu-values.yaml",
    "minimal": CI_VALUES / "minimal-values.yaml",
    "all-features": CI_VALUES / "all-features-values.yaml",
    "m3": CI_VALUES / "m3-values.yaml",
}
KUBE_VERSIONS = ("1.30.0", "1.33.0")
# kind → vendored CustomResourceDefinition (schemas/README.md says where each comes from).
CRD_FILES = {
    "RayService": "ray.io_rayservices.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
}
# libyaml parses the ~1 MB CRDs ~10x faster than the pure-Python loader.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
INT32 = (-(2**31), 2**31 - 1)


def load_values(name: str) -> dict[str, Any]:
    path = VALUES_FILES[name]
    if "MSASERVE_CI_VALUES" in os.environ and not path.exists():
        return {}
    return yaml.safe_load(path.read_text())


def merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """top over base, maps merged key by key as Helm merges values files."""
    out = dict(base)
    for key, value in top.items():
        both_maps = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = merged(base[key], value) if both_maps else value
    return out


def with_site(values: dict[str, Any]) -> dict[str, Any]:
    """values on top of ci/default-values.yaml: what every install must give (image, Secrets)."""
    return merged(load_values("default"), values)


def render_docs(chart: helm_python.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the chart renders (NOTES.txt excluded), parsed."""
    out = chart.render(values=values, name="demo", namespace="ml", is_install=True)
    docs = []
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def strict_crd_schema(schema: Any) -> Any:
    """A CRD openAPIV3Schema made checkable by jsonschema, and strict like `kubectl --validate=strict`.

    Objects with `properties` reject unknown fields (the API server would prune or refuse them);
    `nullable` admits null; `x-kubernetes-int-or-string` admits both; int32 formats get their range.
    `x-kubernetes-validations` (CEL rules) cannot be evaluated here and are dropped.
    """
    if isinstance(schema, list):
        return [strict_crd_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_crd_schema(v) for k, v in schema.items() if k != "x-kubernetes-validations"}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("format") == "int32":
        out["minimum"], out["maximum"] = INT32
    if out.pop("nullable", False):
        return {"anyOf": [out, {"type": "null"}]}
    return out
