"""The code passes ruff's lint and format checks as pyproject.toml configures them (ruff comes with the test extra)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["mlmlab", "tests", "benchmarks", "tools"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *CHECKED], cwd=ROOT, capture_output=True, text=True)


def test_ruff_lint_passes():
    result = ruff("check", "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    result = ruff("format", "--check", "--no-cache")
    assert result.returncode == 0, "run `ruff format mlmlab tests benchmarks tools`:\n" + result.stdout + result.stderr
