"""Markdown tables of benchmarks/results/m3.json for docs/performance-m3.md (what the page shows is
what the JSON holds).

    python benchmarks/serving/m3_tables.py [benchmarks/results/m3.json]
"""

import json
import sys

PARTS = ("attention", "indexer", "moe", "dense_mlp", "rest", "total")


def value(data: dict, key: str) -> str:
    entry = data.get(key)
    if entry is None or entry["value"] is None:
        return "—"
    v = entry["value"]
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def traffic(data: dict) -> list[str]:
    lines = ["| workload | MSA tokens/s | dense tokens/s | MSA / dense | MSA TPOT p50 ms | dense TPOT p50 ms "
             "| MSA TTFT p50 ms | dense TTFT p50 ms |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("agentic", "mooncake"):
        for level in (1, 8, 32):
            if f"m3.{name}_throughput_ratio_c{level}" not in data:
                continue
            cells = [value(data, f"m3.{name}_{b}_c{level}_output_tok_s") for b in ("msa", "dense")]
            cells.append(value(data, f"m3.{name}_throughput_ratio_c{level}") + "×")
            cells += [value(data, f"m3.{name}_{b}_c{level}_tpot_p50_ms") for b in ("msa", "dense")]
            cells += [value(data, f"m3.{name}_{b}_c{level}_ttft_p50_ms") for b in ("msa", "dense")]
            lines.append(f"| {name} c = {level} | " + " | ".join(cells) + " |")
    return lines


def breakdown(data: dict, key: str) -> list[str]:
    entry = data.get(key)
    if entry is None:
        return []
    lines = ["| backend | step | " + " | ".join(PARTS) + " |", "|---|---|" + "---:|" * len(PARTS)]
    for row in entry["table"]:
        cells = " | ".join(f"{row[p]:.3f}" if p in row else "void" for p in PARTS)
        lines.append(f"| {row['backend']} | {row['step']} | {cells} |")
    return lines


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/m3.json"
    with open(path) as f:
        data = json.load(f)
    print("\n".join(traffic(data)))
    for key in sorted(k for k in data if k.endswith("step_breakdown")):
        print()
        print("\n".join(breakdown(data, key)))
    print()
    for key, entry in sorted(data.items()):
        scalar = "value" in entry and "table" not in entry
        if scalar and any(word in key for word in ("speedup", "prefill", "session")):
            print(f"{key}: {entry['value']} {entry['unit']}  ({entry.get('note', '')[:160]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
