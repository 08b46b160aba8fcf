"""The design's dependency arrows are enforced: `lint-imports` (the contracts in pyproject.toml) passes on
the package and fails when a part imports what the design says it never may."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports with the repo's contracts on the `msaserve` package found under `tree`."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("layering")
    shutil.copytree(REPO / "msaserve", tree / "msaserve", ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def test_the_package_keeps_every_contract(package_copy: Path) -> None:
    result = _lint(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "bad_import", "contract"),
    [
        ("kernels/rotary.py", "import msaserve.models.config", "kernels import nothing of ours"),
        ("kvcache/codec.py", "import msaserve.engine.kv.pages", "the KV cache service moves bytes"),
        ("router/policies.py", "import msaserve.models.transformer", "the router sees loads"),
        ("preprocess/image.py", "import torch", "preprocess runs on CPU replicas"),
        ("platform/errors.py", "import msaserve.models.loader", "the platform reaches models"),
    ],
)
def test_a_forbidden_import_fails(package_copy: Path, module: str, bad_import: str, contract: str) -> None:
    path = package_copy / "msaserve" / module
    original = path.read_text()
    try:
        path.write_text(original + f"\n{bad_import}  # added by the test\n")
        result = _lint(package_copy)
    finally:
        path.write_text(original)
    assert result.returncode != 0, result.stdout
    assert "1 broken" in result.stdout
    broken = result.stdout.split("Broken contracts", 1)[1]
    assert contract in " ".join(broken.split()), result.stdout
