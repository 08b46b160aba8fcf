"""The grouped MoE's stage breakdown (benchmarks/models/bench_moe_stages.py) in its CPU smoke mode: the
staged pass still computes grouped.experts (the script checks that itself), and the JSON entry and the
printed table name every stage and every GEMM comparison at every size. Behaviour only, never speed."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "models"))

import bench_moe_stages


def test_stage_breakdown_smoke_has_every_stage(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    output = tmp_path / "moe_stages.json"
    assert bench_moe_stages.main(["--device", "cpu", "--output", str(output)]) == 0
    entry = json.loads(output.read_text())["m3.moe_stage_breakdown"]
    assert {"value", "unit", "command", "hardware", "date", "git_revision", "table"} <= entry.keys()
    head = entry["table"][str(bench_moe_stages.SMOKE.headline_tokens)]["stages_ms"]
    assert entry["value"] == round((head["gate_up_gemm"] + head["down_gemm"]) / head["total"], 3)
    assert sorted(map(int, entry["table"])) == sorted(bench_moe_stages.SMOKE.tokens)
    for row in entry["table"].values():
        assert set(row["stages_ms"]) == {*bench_moe_stages.STAGES, "total"}
        assert all(ms > 0 for ms in row["stages_ms"].values())
        assert set(row["gemms"]) == set(bench_moe_stages.GEMMS)
        for gemm in row["gemms"].values():
            assert {"random_ms", "balanced_ms", "dense_floor_ms", "weight_floor_ms"} <= gemm.keys()
    table = capsys.readouterr().out.split("stages of one grouped pass")[-1]
    assert all(stage in table for stage in bench_moe_stages.STAGES)


def test_stage_breakdown_writes_no_json_unasked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert bench_moe_stages.main(["--device", "cpu"]) == 0
    assert not any(tmp_path.iterdir())
