"""Hostile-input benchmark: >= 1,000 schemathesis cases against a live local `tiny` app.

    .venv/bin/python benchmarks/reliability/fuzz.py [--examples-per-operation 120] [--seed 1]

Every operation of the served OpenAPI schema gets schema-valid, schema-violating and (with a body)
served-model cases; it counts 5xx answers and schema violations, prints a table, and writes
`reliability.fuzz_cases` and `reliability.fuzz_5xx` to benchmarks/results/reliability.json
(merged with what is there). The case driver is shared with tests/reliability (the CI run).
"""

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))
sys.path.insert(0, str(ROOT / "tests"))

from local_serve_app import start_live_app  # noqa: E402
from reliability_fuzzing import fuzz, fuzz_serve_config  # noqa: E402

API_KEY = "fuzz-bench-key"
SERVE_CONFIG = fuzz_serve_config(API_KEY)
RESULTS = ROOT / "benchmarks" / "results" / "reliability.json"


def entry(value: float, unit: str, command: str) -> dict:
    revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "value": value,
        "unit": unit,
        "command": command,
        "hardware": f"CPU only, {platform.processor() or platform.machine()}, local Ray (4 CPUs declared)",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "git_revision": revision.stdout.strip(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples-per-operation", type=int, default=120)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with start_live_app(SERVE_CONFIG) as app:
        start = time.monotonic()
        report = fuzz(app.base_url, API_KEY, "msaserve/tiny", args.examples_per_operation, args.seed)
        elapsed = time.monotonic() - start
    command = (
        f"python benchmarks/reliability/fuzz.py --examples-per-operation "
        f"{args.examples_per_operation} --seed {args.seed}"
    )
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["reliability.fuzz_cases"] = entry(report.num_cases, "cases", command)
    results["reliability.fuzz_5xx"] = entry(len(report.server_errors), "responses", command)
    results["reliability.fuzz_schema_violations"] = entry(len(report.violations), "responses", command)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    for line in (report.server_errors + report.violations)[:20]:
        print(line)
    print(f"\n{'operation [kind of case]':<62} {'cases':>6}")
    for label, count in sorted(report.per_operation.items()):
        print(f"{label:<62} {count:>6}")
    print(f"{'total':<62} {report.num_cases:>6}")
    print(
        f"statuses {dict(sorted(report.statuses.items()))}; 5xx: {len(report.server_errors)} (goal 0); "
        f"schema violations: {len(report.violations)}; {elapsed:.0f} s"
    )
    return 0 if not report.server_errors and not report.violations else 1


if __name__ == "__main__":
    sys.exit(main())
