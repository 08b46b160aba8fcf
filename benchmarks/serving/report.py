"""Benchmark results: `<area>.<metric>` entries (`engine.*`, or `m3.*` for the m3-mini figures) with
value, unit, command, hardware, date and git revision, merged into a JSON file (so parts run
separately add up), and a table printed last."""

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys

import torch


def hardware(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        return f"{torch.cuda.get_device_name()} ({memory:.0f} GiB), torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def git_revision() -> str:
    """HEAD's short hash, or MSASERVE_GIT_REVISION where the tree travels without .git (the GPU run)."""
    if os.environ.get("MSASERVE_GIT_REVISION"):
        return os.environ["MSASERVE_GIT_REVISION"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Report:
    def __init__(self, args: argparse.Namespace, model: str, area: str = "engine") -> None:
        self.device = args.device
        self.area = area
        self.model = model
        self.command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        self.entries: dict[str, dict] = {}
        self.revision = git_revision()

    def add(self, metric: str, value: float, unit: str, model: str | None = None, note: str | None = None,
            area: str | None = None, **extra: object) -> None:
        """note: how the figure was measured (e.g. the traffic parts' window rule); area: another
        area than the report's (the key's prefix); extra: more fields of the entry (a table)."""
        entry = {
            "value": None if isinstance(value, float) and math.isnan(value) else round(float(value), 4),
            "unit": unit,
            "command": self.command,
            "hardware": hardware(self.device if model is None else "cpu"),
            "model": model or self.model,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_revision": self.revision,
        }
        if note:
            entry["note"] = note
        entry.update(extra)
        self.entries[f"{area or self.area}.{metric}"] = entry
        print(f"{metric}: {value:.4g} {unit}", file=sys.stderr, flush=True)

    def write(self, path: str) -> None:
        existing = {}
        if os.path.exists(path):
            with open(path) as f:
                existing = json.load(f)
        existing.update(self.entries)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(dict(sorted(existing.items())), f, indent=2)
            f.write("\n")

    def print_table(self) -> None:
        width = max((len(k) for k in self.entries), default=10)
        print(f"\n{'metric'.ljust(width)}  {'value':>12}  unit      model")
        for key, entry in self.entries.items():
            value = "n/a" if entry["value"] is None else f"{entry['value']:.4g}"
            print(f"{key.ljust(width)}  {value:>12}  {entry['unit']:<8}  {entry['model']}")
