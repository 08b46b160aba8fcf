"""The routing simulator runs each policy once by default (benchmarks/router/simulate.py): the
simulated Ray routers register in `POLICY_CLASSES` when ray_baselines is imported, so they were
listed twice and every sweep ran them twice (issue 29, third pass)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "router"))

import simulate


def test_default_policies_are_listed_once():
    names = simulate.POLICY_NAMES
    assert len(names) == len(set(names))
    assert {"kv_aware", "ray_pow2", "ray_prefix_affinity"} <= set(names)
