"""Merge every benchmark's `<area>.<metric>` entries into benchmarks/results/summary.json.

Each benchmark writes its own benchmarks/results/<area>.json (so parallel runs never clobber one
file); this collects the entries that carry a value, command, hardware, date and git revision.

  python benchmarks/merge_summary.py
"""

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REQUIRED = ("value", "unit", "command", "date")


def entries(path: Path) -> dict[str, dict]:
    data = json.loads(path.read_text())
    found = {}
    for key, entry in data.items():
        if "." in key and isinstance(entry, dict) and "value" in entry:
            missing = [field for field in REQUIRED if field not in entry]
            if missing:
                raise SystemExit(f"{path.name}: {key} lacks {', '.join(missing)}")
            found[key] = {**entry, "source": f"benchmarks/results/{path.name}"}
    return found


def main() -> int:
    summary: dict[str, dict] = {}
    for path in sorted(RESULTS.glob("*.json")):
        if path.name != "summary.json":
            summary.update(entries(path))
    out = RESULTS / "summary.json"
    out.write_text(json.dumps(dict(sorted(summary.items())), indent=2) + "\n")
    print(f"{len(summary)} entries → {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
