"""The chart under test: paths, values files, rendering, and CRD schemas made checkable.

Shared by tests/helm (imported by name: tests/ has no packages, hence the unique module name).
"""

from pathlib import Path
from typing import Any

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "msaserve"
SCHEMAS = Path(__file__).resolve().parent / "schemas"  # KubeRay CRDs, see schemas/README.md
VALUES_FILES = {
    "default": None,
    "gpu": CHART / "ci" / "gpu-values.yaml",
    "minimal": CHART / "ci" / "minimal-values.yaml",
    "all-features": CHART / "ci" / "all-features-values.yaml",
}
KUBE_VERSIONS = ("1.30.0", "1.33.0")
# libyaml parses the ~1 MB CRDs ~10x faster than the pure-Python loader.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
INT32 = (-(2**31), 2**31 - 1)


def load_values(name: str) -> dict[str, Any]:
    path = VALUES_FILES[name]
    return {} if path is None else yaml.safe_load(path.read_text())


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
