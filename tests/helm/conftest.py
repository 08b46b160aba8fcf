"""Fixtures for the chart tests: rendering with the real Helm library and the KubeRay CRD schemas.

The CRD YAMLs are ~1 MB each: they are parsed once per session.
"""

from collections.abc import Callable
from typing import Any

import helm_python
import jsonschema
import pytest
import yaml
from helm_chart import (
    CHART,
    CRD_FILES,
    SCHEMAS,
    VALUES_FILES,
    YAML_LOADER,
    load_values,
    render_docs,
    strict_crd_schema,
    with_site,
)


@pytest.fixture(scope="session")
def chart():
    with helm_python.Chart.load(str(CHART)) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """Render values on top of the site values (ci/default-values.yaml)."""
    return lambda values: render_docs(chart, with_site(values))


@pytest.fixture(scope="session")
def rendered(chart) -> dict[str, list[dict[str, Any]]]:
    """Values-file name → rendered objects, for every values file."""
    return {name: render_docs(chart, load_values(name)) for name in VALUES_FILES}


@pytest.fixture(scope="session")
def crd_documents() -> dict[str, dict[str, Any]]:
    """The CRD YAMLs as dicts, keyed by kind (parsed once: the KubeRay ones are ~1 MB each)."""
    docs = {}
    for kind, file in CRD_FILES.items():
        docs[kind] = yaml.load((SCHEMAS / file).read_text(), Loader=YAML_LOADER)
        assert docs[kind]["spec"]["names"]["kind"] == kind
    return docs


@pytest.fixture(scope="session")
def crd_validators(crd_documents) -> dict[str, jsonschema.Draft4Validator]:
    validators = {}
    for kind, crd in crd_documents.items():
        version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        schema = strict_crd_schema(version["schema"]["openAPIV3Schema"])
        validators[kind] = jsonschema.Draft4Validator(schema)
    return validators
