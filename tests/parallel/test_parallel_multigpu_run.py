"""benchmarks/multigpu/run_multigpu.py (issue 34's one call per machine kind) on 2 gloo ranks at
small widths: every layout's tokens equal TP 1's, the moved session's next token equals the
source's, and every key carries its command, date and revision (CPU keys end in `_cpu`)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_multi_gpu_run_script_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "multigpu.json"
    script = ROOT / "benchmarks" / "multigpu" / "run_multigpu.py"
    command = [sys.executable, str(script), "--device", "cpu", "--world", "2", "--output", str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    for key in ("tp2_tokens_equal", "ep2_tokens_equal", "session_move_tokens_equal"):
        assert results[f"multigpu.{key}_cpu"]["value"] is True, key
    for key in ("decode_scaling_tp2", "decode_scaling_ep2", "alltoall_fraction_of_link", "session_move_gbps",
                "session_move_vs_host_staged"):
        assert results[f"multigpu.{key}_cpu"]["value"] > 0, key
    assert "all_reduce 8 calls" in results["multigpu.decode_scaling_tp2_cpu"]["note"]
    assert "all_to_all_single" in results["multigpu.decode_scaling_ep2_cpu"]["note"]
    for entry in results.values():
        assert entry["command"].startswith("python benchmarks/multigpu/run_multigpu.py")
        assert entry["date"] and entry["git_revision"] and entry["gpus"] == 0
    assert "session move" in run.stdout.splitlines()[-1]
