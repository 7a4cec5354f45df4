"""The tree passes ruff with the configuration in pyproject.toml ([tool.ruff]: pyflakes and the pycodestyle rules
the tree passes), so the test command (README.md, run by .ci/run) lints too."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                                reason="ruff is not installed (it is in the 'test' extra: pip install -e '.[test]')")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_tree_passes_ruff():
    done = _ruff(".")
    assert done.returncode == 0, f"ruff check . found:\n{done.stdout}{done.stderr}"


def test_the_configuration_catches_an_unused_import_and_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    done = _ruff("--config", str(ROOT / "pyproject.toml"), str(bad))
    assert done.returncode == 1 and "F401" in done.stdout and "F821" in done.stdout, done.stdout + done.stderr
