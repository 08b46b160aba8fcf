"""The configuration reference (docs/configuration.md), generated from `ServeConfig` itself, so the
documented fields, defaults and ranges are the ones the code checks.

    msaserve deploy-config --write-config-reference docs/configuration.md
"""

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from msaserve.platform.config import ServeConfig

_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"), ("min_length", "length ≥"),
           ("max_length", "length ≤"))

HEADER = """# Configuration reference

Generated from `ServeConfig` (`msaserve/platform/config.py` and the sections each part owns:
`msaserve/engine/settings.py`, `msaserve/kvcache/config.py`, `msaserve/preprocess/limits.py`, ...) by
`msaserve deploy-config --write-config-reference docs/configuration.md`; a test fails when it is stale.
One YAML file holds every section (`msaserve serve --config serve.yaml`); the Helm chart's `serve:`
values are the same schema. Every default below is the only place that value is set.
"""


def _submodel(annotation: Any) -> type[BaseModel] | None:
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    return text or re.sub(r"\b(?:[a-z_]+\.)+([A-Z]\w*)", r"\1", str(annotation).replace("typing.", ""))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else json.dumps(value)
    return json.dumps(field.default, ensure_ascii=False)


def _allowed(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for name, symbol in _BOUNDS:
            value = getattr(meta, name, None)
            if value is not None:
                parts.append(f"{symbol} {value:,}" if isinstance(value, int) else f"{symbol} {value}")
    return ", ".join(parts)


def _rows(model: type[BaseModel], prefix: str, sections: list[tuple[str, type[BaseModel], str]]) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is not None and field.default_factory is not None:
            sections.append((f"{prefix}{name}", sub, field.description or ""))
            continue
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        kind = _type_name(field.annotation).replace("|", "\\|")
        rows.append(f"| `{name}` | {kind} | `{_default(field)}` | {_allowed(field)} | {description} |")
    return rows


def render_reference() -> str:
    """The whole reference as Markdown: one table per section, in schema order."""
    out = [HEADER]
    sections: list[tuple[str, type[BaseModel], str]] = []
    _rows(ServeConfig, "", sections)
    while sections:
        path, model, description = sections.pop(0)
        nested: list[tuple[str, type[BaseModel], str]] = []
        rows = _rows(model, f"{path}.", nested)
        sections[:0] = nested
        out.append(f"\n## `{path}`\n\n{description}\n")
        if rows:
            out += ["| field | type | default | allowed | what it does |",
                    "| --- | --- | --- | --- | --- |", *rows]
    return "\n".join(out) + "\n"


def write_reference(path: str | Path) -> bool:
    """Write the reference to `path`; True if it changed."""
    path = Path(path)
    text = render_reference()
    old = path.read_text() if path.exists() else None
    if text != old:
        path.write_text(text)
    return text != old
