"""Collects bench_msa.py's figures and writes them: JSON entries `kernels.<metric>`, raw tables,
plot data, a markdown page, a log-log plot (when matplotlib is importable), and the final table."""

import datetime
import json
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Report:
    command: str
    hardware: str
    git_revision: str
    metrics: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    plot: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)

    def metric(self, name: str, value: float, unit: str, target: str, **extra: object) -> None:
        self.metrics[f"kernels.{name}"] = {
            "value": round(float(value), 4), "unit": unit, "target": target,
            "command": self.command, "hardware": self.hardware,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_revision": self.git_revision, **extra,
        }

    def row(self, table: str, **values: object) -> None:
        self.tables.setdefault(table, []).append(values)

    def write(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        raw = {"tables": self.tables, "notes": self.notes, "plot": self.plot, **self.raw}
        doc = {**self.metrics, "raw": raw}
        (out_dir / "kernels.json").write_text(json.dumps(doc, indent=1, default=float))
        (out_dir / "performance-kernels.md").write_text(self.markdown())
        try:
            plot(self.plot, out_dir / "kernels_latency.png")
        except ImportError:
            self.notes.append("matplotlib missing: plot data is in kernels.json raw.plot")

    def markdown(self) -> str:
        lines = ["# MSA kernel performance", "",
                 f"Hardware: {self.hardware}; git {self.git_revision}; command `{self.command}`.", "",
                 "## Targets", "", "| metric | value | unit | target |", "| --- | --- | --- | --- |"]
        for name, m in self.metrics.items():
            lines.append(f"| `{name}` | {m['value']} | {m['unit']} | {m['target']} |")
        for table, rows in self.tables.items():
            if not rows:
                continue
            keys = list(rows[0].keys())
            lines += ["", f"## {table}", "", "| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
            lines += ["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in rows]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def print_tables(self) -> None:
        for table, rows in self.tables.items():
            if not rows:
                continue
            keys = list(rows[0].keys())
            print(f"\n== {table}")
            print("  ".join(f"{k:>12}" for k in keys))
            for r in rows:
                print("  ".join(f"{_fmt(r.get(k)):>12}" for k in keys))
        for note in self.notes:
            print("note:", note)
        print("\n== targets")
        for name, m in self.metrics.items():
            print(f"{name:42} {m['value']:>10} {m['unit']:10} target {m['target']}")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def plot(data: dict, path: os.PathLike) -> None:
    """Log-log latency against context length, MSA against dense, for prefill and decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, kind in zip(axes, ("prefill", "decode"), strict=True):
        for name, series in data.get(kind, {}).items():
            xs, ys = zip(*sorted(zip(series["tokens"], series["ms"], strict=True)), strict=True)
            style = "--" if "extrapolated" in name else "-"
            ax.plot(xs, ys, style, marker="o", markersize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{kind} attention, M3 shape, one layer")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
