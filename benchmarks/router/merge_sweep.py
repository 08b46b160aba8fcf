"""Replace one policy's rows of a sweep with a newer sweep's (after a change to that policy only).

The simulator is deterministic (seed 0), so the other policies' rows of the older sweep are what a
full re-run would give as long as their code did not change; this saves re-running them. The
merged sweep then goes through `simulate.py --from-sweep` for the headline figures.

    python benchmarks/router/merge_sweep.py benchmarks/results/router_sweep.json new_sweep.json
"""

import argparse
import json
import sys
from pathlib import Path


def merge(base: dict, new: dict) -> dict:
    policies = {r["policy"] for r in new["rows"]}
    keys = {(r["replicas"], r["scale"]) for r in new["rows"]}
    missing = {(r["replicas"], r["scale"]) for r in base["rows"]} - keys
    if missing:
        raise ValueError(f"the new sweep lacks (replicas, scale) {sorted(missing)}: allowed the base's grid")
    rows = [r for r in base["rows"] if r["policy"] not in policies] + new["rows"]
    return {**base, "kv_aware": new.get("kv_aware", base.get("kv_aware")), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="sweep JSON to update in place")
    parser.add_argument("new", help="sweep JSON whose policies replace the base's rows of them")
    args = parser.parse_args(argv)
    base, new = (json.loads(Path(p).read_text()) for p in (args.base, args.new))
    Path(args.base).write_text(json.dumps(merge(base, new), indent=1) + "\n")
    print(f"{args.base}: rows of {sorted({r['policy'] for r in new['rows']})} replaced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
